"""What freeing the blocks behind a sliding window saves: a tiny Mistral whose every layer attends
through a window, with and without ``free_blocks_outside_window``, side by side in one run.

    python experiments/bench_window_memory.py [--window 64] [--block-size 16] [--num-seqs 16]
                                              [--prompt-len 32] [--output-len 1024] [--pool-blocks 160]

1. A pool large enough for everything: the peak number of blocks in use, and per sequence.
2. A pool of ``--pool-blocks`` blocks: how many sequences run per step on average, the
   preemptions, and the engine steps the batch takes.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import numpy as np

import bench_common  # noqa: F401  (puts this checkout on the path)
from paged_jax import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_args import EngineArgs
from paged_jax.models.tiny import make_tiny_model


def run(model: str, a, free: bool, pool_blocks) -> dict:
    max_len = a.prompt_len + a.output_len + a.block_size
    engine = LLMEngine(EngineArgs(model=model, block_size=a.block_size, max_model_len=max_len,
                                  num_kv_blocks=pool_blocks, max_num_seqs=a.num_seqs,
                                  free_blocks_outside_window=free))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    for i in range(a.num_seqs):
        engine.add_request(str(i), None, params, rng.integers(3, 500, size=a.prompt_len).tolist())
    peak_blocks = running = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak_blocks = max(peak_blocks, engine.block_manager.get_usage().num_used_gpu_blocks)
        running += len(engine.scheduler.running)
    stats = engine.get_stats()
    return dict(peak_blocks=peak_blocks, mean_running=running / steps, steps=steps,
                preemptions=sum(stats["num_preemptions"].values()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--pool-blocks", type=int, default=160)
    a = ap.parse_args(argv)
    logging.getLogger("paged_jax").setLevel(logging.ERROR)  # one line per preemption otherwise
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, family="mistral", sliding_window=a.window,
                                    max_position_embeddings=a.prompt_len + a.output_len + 2 * a.block_size))
        bound = -(-a.window // a.block_size) + 1
        print(f"tiny Mistral, window {a.window} on every layer, block size {a.block_size}, {a.num_seqs} sequences "
              f"of {a.prompt_len} + {a.output_len} tokens")
        big = {free: run(model, a, free, None) for free in (False, True)}
        print(f"\n1. unconstrained pool: peak blocks in use  kept {big[False]['peak_blocks']:6d}   "
              f"freed {big[True]['peak_blocks']:6d}   ratio kept / freed {big[False]['peak_blocks'] / big[True]['peak_blocks']:.1f}x")
        print(f"   per sequence: kept {big[False]['peak_blocks'] / a.num_seqs:.1f}, freed "
              f"{big[True]['peak_blocks'] / a.num_seqs:.1f} (bound while decoding: ceil(window / block) + 1 = {bound})")
        small = {free: run(model, a, free, a.pool_blocks) for free in (False, True)}
        print(f"\n2. pool of {a.pool_blocks} blocks:")
        for free in (False, True):
            r = small[free]
            print(f"   {'freed' if free else 'kept '}: {r['mean_running']:5.1f} sequences per step on average, "
                  f"{r['preemptions']:4d} preemptions, {r['steps']:5d} steps")
        print(f"   sequences per step, freed / kept: {small[True]['mean_running'] / small[False]['mean_running']:.1f}x; "
              f"steps, kept / freed: {small[False]['steps'] / small[True]['steps']:.2f}x")


if __name__ == "__main__":
    main()
