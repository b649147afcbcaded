"""Offline throughput, vLLM's ``benchmark_throughput.py`` on the CPU: all requests at once.

    python experiments/bench_throughput.py --backend paged-jax --dataset sharegpt-like --num-prompts 128
    python experiments/bench_throughput.py --backend hf --hf-max-batch-size 32 --input-len 64 --output-len 64
    python experiments/bench_throughput.py --compare          # the side-by-side table of the README
    python experiments/bench_throughput.py --dataset sharegpt-like --compare-chunked   # chunked prefill off vs default

``--compare`` runs, in one process on one machine, the same requests through: Hugging Face
``generate`` one request at a time (on the first ``--hf-sequential-prompts`` requests: its rate
does not depend on how many there are), Hugging Face static batches (left padding, in arrival
order, each batch size of ``--hf-batch-sizes``; the best is kept), paged-jax with contiguous
Orca(Max)-style reservation and paged-jax itself, and prints our throughput over each.

Orca(Max) is our own engine with the scheduling policy ``Orca("max")`` (the one the
simulator's baselines use): every admitted request reserves ``max_model_len`` slots of contiguous
blocks up front, so at most ``usable_kv_slots // max_model_len`` requests run at once. A
reservation holds one sequence: with ``--n`` > 1 the Orca row is left out.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench_common import (add_request_args, describe_requests, engine_max_len, format_summary, gpt2_124m_model,
                          load_hf, make_llm, make_requests, run_hf, run_paged_jax, summarize)

from paged_jax.policy import FCFS, Orca  # after bench_common, which puts this checkout on the path


def report_engine(res: dict) -> str:
    t = res["timings"]
    total = sum(t[k] for k in ("schedule", "execute", "process"))
    parts = {k: t[k] for k in ("schedule", "prepare", "cache_ops", "device", "sample", "process", "detokenize")}
    return (f"  {res['steps']} steps, {res['new_compilations']} compilations during the run; step time: "
            + ", ".join(f"{k} {100 * v / max(total, 1e-9):.1f}%" for k, v in parts.items())
            + " (detokenize is part of process)")


def compare(a, model: str, requests) -> dict:
    import torch

    mml = a.max_total_len
    print(describe_requests(requests))
    print(f"torch {torch.__version__} with {torch.get_num_threads()} threads; max_model_len {mml}")
    rows = {}
    hf = load_hf(model, a.dtype)
    sub = requests[: a.hf_sequential_prompts]
    r = run_hf(hf, a, sub, 1)
    rows["HF generate, one request at a time"] = summarize(sub, r, a.n)
    print(format_summary(f"HF one at a time (first {len(sub)} requests)", rows["HF generate, one request at a time"]),
          flush=True)
    best = None
    for bs in a.hf_batch_sizes:
        s = summarize(requests, run_hf(hf, a, requests, bs), a.n)
        print(format_summary(f"HF static batches of {bs}", s), flush=True)
        if best is None or s["tokens_per_s"] > best[1]["tokens_per_s"]:
            best = (bs, s)
    rows[f"HF static batches (best: {best[0]})"] = best[1]
    del hf

    llm = make_llm(a, model, mml, max_num_seqs=min(a.max_num_seqs, len(requests) * a.n), warm_up=not a.no_warm_up)
    engine = llm.llm_engine
    usable = engine.block_manager.gpu_allocator.num_total_blocks * a.block_size
    full = engine.scheduler_config.max_num_seqs
    if a.n == 1:
        engine.scheduler.policy = Orca("max")
        res = run_paged_jax(llm, a, requests)
        engine.scheduler.policy = FCFS()
        rows["paged-jax with Orca(Max) reservation"] = summarize(requests, res, a.n)
        print(format_summary(f"paged-jax, Orca(Max): {usable} KV slots, max_model_len {mml} reserved per request "
                             f"(at most {usable // mml} at once)", summarize(requests, res, a.n)))
        print(report_engine(res), flush=True)
    res = run_paged_jax(llm, a, requests)
    ours = summarize(requests, res, a.n)
    rows["paged-jax"] = ours
    print(format_summary(f"paged-jax ({usable} KV slots, max_num_seqs {full})", ours))
    print(report_engine(res))
    print("\npaged-jax throughput (tokens/s) over:")
    for name, s in rows.items():
        if name != "paged-jax":
            print(f"  {name:<62} {ours['tokens_per_s'] / s['tokens_per_s']:6.2f}x")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_args(ap)
    ap.add_argument("--compare", action="store_true", help="HF one at a time, HF static batches, Orca(Max), ours")
    ap.add_argument("--hf-sequential-prompts", type=int, default=16)
    ap.add_argument("--hf-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128])
    ap.add_argument("--compare-chunked", action="store_true",
                    help="paged-jax with chunked prefill off (the old default), then with the engine's default, "
                         "the same requests run twice on each engine, one process")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    if a.compare and a.dataset is None and a.input_len is None:
        a.dataset = "sharegpt"
    if a.compare and a.num_kv_blocks is None:
        a.num_kv_blocks = 1024  # KV memory for ~16k tokens: the constraint Orca(Max) reserves against
    model = a.model or gpt2_124m_model()
    import json as _json
    from pathlib import Path

    from paged_jax.models import model_config_from_hf

    requests = make_requests(a, model_config_from_hf(_json.loads((Path(model) / "config.json").read_text())).vocab_size)
    if a.compare:
        out = compare(a, model, requests)
    elif a.compare_chunked:
        out = {}
        print(describe_requests(requests))
        for chunked in ("off", "default"):
            llm = make_llm(a, model, engine_max_len(a, requests),
                           warm_up=not a.no_warm_up, chunked=chunked)
            cfg = llm.llm_engine.scheduler_config
            for run in ("first", "second"):  # the second run compiles nothing (shapes warm-up missed included)
                res = run_paged_jax(llm, a, requests)
                out[chunked, run] = summarize(requests, res, a.n)
                print(format_summary(f"paged-jax, chunked prefill {chunked} ({'on' if cfg.enable_chunked_prefill else 'off'}"
                                     f", max_num_batched_tokens {cfg.max_num_batched_tokens}), {run} run",
                                     out[chunked, run]))
                print(report_engine(res), flush=True)
            del llm
        for run in ("first", "second"):
            print(f"default over off, {run} runs: "
                  f"{out['default', run]['tokens_per_s'] / out['off', run]['tokens_per_s']:.2f}x tokens/s")
        out = {f"{c} {r}": v for (c, r), v in out.items()}
    elif a.backend == "hf":
        hf = load_hf(model, a.dtype)
        out = summarize(requests, run_hf(hf, a, requests, a.hf_max_batch_size or 1), a.n)
        print(describe_requests(requests))
        print(format_summary(f"hf (batch {a.hf_max_batch_size or 1})", out))
    else:
        llm = make_llm(a, model, engine_max_len(a, requests),
                       warm_up=not a.no_warm_up)
        res = run_paged_jax(llm, a, requests)
        out = summarize(requests, res, a.n)
        print(describe_requests(requests))
        print(format_summary("paged-jax", out))
        print(report_engine(res))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
