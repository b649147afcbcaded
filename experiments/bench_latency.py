"""Latency of one batch, vLLM's ``benchmark_latency.py`` on the CPU.

    python experiments/bench_latency.py --backend paged-jax --input-len 32 --output-len 128 --batch-size 8
    python experiments/bench_latency.py --backend hf --input-len 32 --output-len 128 --batch-size 8

Runs the same batch of requests ``--num-iters`` times (after ``--num-iters-warmup``) and prints
the batch latency (mean and percentiles), requests/s and tokens/s, and the per-request
completion times of the last iteration. The hf backend runs the batch as one static batch
(left padding). ``--num-prompts`` is an alias of ``--batch-size``; ``--dataset`` draws lengths.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench_common import (add_request_args, describe_requests, format_summary, gpt2_124m_model, load_hf,
                          make_llm, make_requests, max_len, run_hf, run_paged_jax, summarize)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_args(ap)
    ap.add_argument("--batch-size", type=int, default=None, help="requests per batch (default: --num-prompts)")
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    ap.set_defaults(num_prompts=8)
    a = ap.parse_args(argv)
    if a.batch_size is not None:
        a.num_prompts = a.batch_size
    if a.num_iters < 1 or a.num_iters_warmup < 0:
        raise SystemExit(f"--num-iters must be >= 1 and --num-iters-warmup >= 0, got {a.num_iters}, "
                         f"{a.num_iters_warmup}")
    if a.dataset is None and a.input_len is None and a.output_len is None:
        a.input_len, a.output_len = 32, 128
    model = a.model or gpt2_124m_model()
    from pathlib import Path

    from paged_jax.models import model_config_from_hf

    vocab = model_config_from_hf(json.loads((Path(model) / "config.json").read_text())).vocab_size
    requests = make_requests(a, vocab)
    print(describe_requests(requests))
    if a.backend == "hf":
        hf = load_hf(model, a.dtype)
        run = lambda: run_hf(hf, a, requests, len(requests))  # noqa: E731
    else:
        llm = make_llm(a, model, max(max_len(requests), a.max_total_len if a.dataset else 0),
                       max_num_seqs=max(len(requests) * a.n, 1), warm_up=not a.no_warm_up)
        run = lambda: run_paged_jax(llm, a, requests)  # noqa: E731
    for _ in range(a.num_iters_warmup):
        run()
    times, last = [], None
    for _ in range(a.num_iters):
        t = time.perf_counter()
        last = run()
        times.append(time.perf_counter() - t)
    t = np.array(times)
    out = {"avg_latency_s": float(t.mean()), "p50_s": float(np.percentile(t, 50)),
           "p90_s": float(np.percentile(t, 90)), "p99_s": float(np.percentile(t, 99)),
           "last_iteration": summarize(requests, last, a.n)}
    if a.backend == "paged-jax":
        out["new_compilations"] = last["new_compilations"]
    print(f"{a.backend}: batch latency avg {out['avg_latency_s']:.3f} s, p50 {out['p50_s']:.3f} s, "
          f"p90 {out['p90_s']:.3f} s, p99 {out['p99_s']:.3f} s over {a.num_iters} iterations")
    print(format_summary("last iteration", out["last_iteration"]))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
