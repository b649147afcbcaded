"""The forward pass of a speculative verification step against a decode step's, side by side.

    python experiments/bench_verify_step.py [--k 4] [--contexts 100,700] [--batches 1,4,16] [--repeats 60]

The default model's jitted step (``ModelRunner.run_batch``, the engine's attention backend: native where
it builds; ``PAGED_JAX_NATIVE=0`` for the jnp reference) on three batches of ``batch`` sequences at
``context`` cached tokens: ``decode`` (one token each), ``tiles`` (each sequence's pending token and
``k`` drafts as one query tile, every token's logits: how the native backend scores drafts) and
``rows`` (each of those ``k + 1`` tokens a one-token row of its own over the sequence's block table:
how the others do, ``paged_jax/executor/draft_rows.py``). Each step's time is its best of ``--repeats``
runs, the three interleaved (a shared machine only slows a run down). Prints milliseconds and the
ratios to the decode step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4, help="draft tokens per sequence")
    ap.add_argument("--contexts", default="100,700", help="comma-separated cached tokens per sequence")
    ap.add_argument("--batches", default="1,4,16", help="comma-separated sequences per step")
    ap.add_argument("--repeats", type=int, default=60)
    a = ap.parse_args(argv)

    import jax

    from paged_jax import LLM
    from paged_jax.executor.batch import SeqChunk, prepare_batch

    batches = [int(b) for b in a.batches.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    block_size, k = 16, a.k
    blocks_per_seq = -(-(max(contexts) + k + 1) // block_size)
    runner = LLM(num_kv_blocks=blocks_per_seq * max(batches) + 1, max_model_len=max(contexts) + k + 1,
                 block_size=block_size).llm_engine.runner

    def seconds(batch, all_logits):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.run_batch(batch, all_logits))
        return time.perf_counter() - t0

    print(f"default model, attention backend {runner.attention_backend}, k = {k}; best of {a.repeats} (ms)")
    print(f"{'context':>7} {'batch':>5} {'decode':>8} {'tiles':>8} {'rows':>8} {'tiles x':>8} {'rows x':>7}")
    for context in contexts:
        for n in batches:
            tables = [list(range(1 + blocks_per_seq * s, 1 + blocks_per_seq * (s + 1))) for s in range(n)]
            steps = {
                "decode": (prepare_batch([SeqChunk([5], context, tables[s]) for s in range(n)], block_size), False),
                "tiles": (prepare_batch([SeqChunk([5] * (k + 1), context, tables[s]) for s in range(n)], block_size),
                          True),
                "rows": (prepare_batch([SeqChunk([5], context + j, tables[s]) for s in range(n) for j in range(k + 1)],
                                       block_size), False),
            }
            best = dict.fromkeys(steps, float("inf"))
            for name, (batch, all_logits) in steps.items():  # compile and warm
                for _ in range(3):
                    seconds(batch, all_logits)
            for _ in range(a.repeats):
                for name, (batch, all_logits) in steps.items():
                    best[name] = min(best[name], seconds(batch, all_logits))
            d, t, r = (best[x] * 1e3 for x in ("decode", "tiles", "rows"))
            print(f"{context:>7} {n:>5} {d:8.3f} {t:8.3f} {r:8.3f} {t / d:8.2f} {r / d:7.2f}", flush=True)


if __name__ == "__main__":
    main()
