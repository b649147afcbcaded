"""Memory saved by sharing KV blocks (the paper's Fig. 15), measured on the real engine.

For parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6), the same
requests run twice on the engine (default: the bundled tiny LLaMA on the CPU):
once with block sharing (samples fork from the prompt; beams fork and free
through the block manager; copy-on-write), once with ``enable_block_sharing=
False`` (every fork copies its parent's blocks). After every step the script
reads the blocks in use; the saving is ``1 - mean(blocks with sharing) /
mean(blocks without)``, the paper's "blocks saved / blocks without sharing".
Both runs must produce the same tokens, which the script checks.

Request lengths are Alpaca-like and ShareGPT-like (see ``experiments/workloads.py``);
every request generates exactly its drawn output length (EOS ignored), as in the
paper's traces. The cache is large enough that nothing is preempted, so both
runs schedule identically and the comparison is step for step.

    python experiments/measure_sharing.py                       # both datasets, n and widths 2, 4, 6
    python experiments/measure_sharing.py --dataset alpaca --num-requests 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.workloads import sample_lengths  # noqa: E402
from paged_jax import SamplingParams  # noqa: E402
from paged_jax.engine import EngineArgs, LLMEngine  # noqa: E402

# Fig. 15 (OPT-13B, Alpaca, bar labels) and the ranges the text gives for ShareGPT.
PAPER = {
    ("alpaca", "parallel"): {2: 6.09, 4: 8.53, 6: 9.79},
    ("alpaca", "beam"): {2: 37.56, 4: 53.13, 6: 55.16},
    ("sharegpt", "parallel"): "16.2-30.5",
    ("sharegpt", "beam"): "44.3-66.3",
}

DIFFERENCES = """\
What differs from the paper's setting:
- Model: a tiny random LLaMA on the CPU, not OPT-13B on an A100. Sharing depends on the
  lengths and on how sequences branch, not on the model's size; but a random model's
  next-token distribution is nearly flat, so its beams branch differently (beams
  are replaced and forked at different rates) than a trained model's.
- Arrivals: all requests are submitted at once (a fixed batch, nothing preempted), where
  the paper served a Poisson trace; savings are averaged over engine steps.
- Lengths: synthetic draws matching the published mean input/output lengths
  (experiments/workloads.py), fewer requests than the paper's hour-long traces.
"""


def make_params(mode: str, k: int, out_len: int, seed: int) -> SamplingParams:
    if mode == "parallel":
        return SamplingParams(n=k, temperature=1.0, seed=seed, max_tokens=out_len, ignore_eos=True)
    return SamplingParams(n=k, best_of=k, use_beam_search=True, temperature=0, max_tokens=out_len,
                          ignore_eos=True)


def run(model, block_size, requests, mode, k, sharing):
    """Run the requests to completion; return (mean blocks in use per step, peak, outputs, steps)."""
    need = sum(k * -(-(p + o) // block_size) for p, o in requests) + 1
    engine = LLMEngine(EngineArgs(model=model, block_size=block_size, num_kv_blocks=need + 8,
                                  max_num_seqs=k * len(requests), enable_block_sharing=sharing))
    rng = np.random.default_rng(0)
    for i, (p, o) in enumerate(requests):
        prompt = rng.integers(3, engine.model_config.vocab_size, size=p).tolist()
        engine.add_request(str(i), None, make_params(mode, k, o, seed=i), prompt_token_ids=prompt)
    used, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
        used.append(engine.block_manager.get_usage().num_used_gpu_blocks)
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.block_manager.gpu_allocator.num_total_blocks
    stats = engine.get_stats()
    if sum(stats["num_preemptions"].values()):
        raise RuntimeError("a request was preempted: the comparison would not be step for step")
    return float(np.mean(used)), max(used), outputs, len(used)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the bundled tiny LLaMA)")
    ap.add_argument("--dataset", choices=["alpaca", "sharegpt"], nargs="+", default=["alpaca", "sharegpt"])
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per run (default: 16 Alpaca-like, 6 ShareGPT-like)")
    ap.add_argument("--n", type=int, nargs="*", default=[2, 4, 6], help="parallel sampling sizes")
    ap.add_argument("--beam-width", type=int, nargs="*", default=[2, 4, 6])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(DIFFERENCES)
    print(f"{'dataset':9} {'mode':9} {'k':>2} {'blocks shared':>13} {'not shared':>10} {'peak':>11} "
          f"{'saving %':>8} {'paper %':>10} {'steps':>5} {'s':>6}")
    for dataset in a.dataset:
        num = a.num_requests or (16 if dataset == "alpaca" else 6)
        ins, outs = sample_lengths(dataset, num, seed=a.seed)
        requests = list(zip(ins.tolist(), outs.tolist()))
        for mode, ks in (("parallel", a.n), ("beam", a.beam_width)):
            for k in ks:
                t0 = time.perf_counter()
                mean_s, peak_s, out_s, steps = run(a.model, a.block_size, requests, mode, k, True)
                mean_n, peak_n, out_n, _ = run(a.model, a.block_size, requests, mode, k, False)
                if out_s != out_n:
                    raise RuntimeError(f"{dataset} {mode} k={k}: outputs differ with and without sharing")
                paper = PAPER[(dataset, mode)]
                paper = f"{paper[k]:.2f}" if isinstance(paper, dict) and k in paper else (
                    paper if isinstance(paper, str) else "-")
                print(f"{dataset:9} {mode:9} {k:>2} {mean_s:13.1f} {mean_n:10.1f} {peak_s:>5}/{peak_n:<5} "
                      f"{100 * (1 - mean_s / mean_n):8.2f} {paper:>10} {steps:>5} {time.perf_counter() - t0:6.1f}",
                      flush=True)
    print(f"\nrequests: {a.num_requests or 'default'} per run, block size {a.block_size}; "
          "outputs with and without sharing identical in every run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
