"""One KV pool for all layers against one pool of pages per attention kind (layer groups), for a
Gemma 3-shaped model at 8k-token contexts, side by side in one run, in pools of the same bytes.

    python experiments/bench_hybrid_memory.py [--window 1024] [--context 8192] [--output-len 1024]
                                              [--block-size 16] [--pools 4,16]

The model is ``paged-jax make-tiny --family gemma3``'s configuration (six layers: five attend
through a window, the sixth sees everything) with Gemma 3's 1,024-token window; the engine (its
scheduler and block managers) runs over the simulated executor, so no array is computed: what is
measured is block accounting, which is the same as with the model. Prompts of ``context -
output_len`` tokens, ``output_len`` new tokens each, chunked prefill.

1. The same load (as many requests as one pool holds at full context, all running together): the
   KV bytes in use when every context reaches ``context`` tokens, as one-pool blocks (a one-pool
   block holds all six layers; a page of the grouped pool one layer), and per group.
2. Pools of the bytes of N full-context sequences in one pool (``--pools``), four times as many
   requests as one pool holds: the sequences running per step while requests wait for blocks
   (what the pool's bytes hold), the peak, and the steps taken. The mean over every step is the
   total sequence-steps over the steps taken, so its ratio is the ratio of steps: requests run
   in whole waves of ``output_len`` decode steps (4 waves in one pool, 2 per kind), so it stays
   near 2x though each wave of the grouped pool holds over 3x the sequences. The grouped pool
   runs twice: its windowed groups taking a prompt's blocks chunk by chunk (the engine's way,
   given the scheduler's token budget), and all at admission (as before per-chunk admission).

The arithmetic bound of (1): 1/6 + 5/6 x (1,024 + one block) / 8,192 = 0.27 of one pool's bytes.
"""

from __future__ import annotations

import argparse

import numpy as np

import bench_common  # noqa: F401  (puts this checkout on the path)
from paged_jax import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.memory import kv_layout, make_block_manager
from paged_jax.models import FAMILIES, model_config_from_hf
from paged_jax.scheduler import SchedulerConfig

from experiments.cost_model import CostModel
from experiments.hardware import A100_40GB, Setup
from experiments.sim_executor import SimClock, SimulatedExecutor


def gemma3_config(window: int, context: int):
    cfg = dict(FAMILIES["gemma3"].tiny_config, sliding_window=window, max_position_embeddings=2 * context,
               vocab_size=512)
    return model_config_from_hf(cfg)


def run(mc, a, grouped: bool, pool_seqs: int, num_requests: int, per_chunk: bool = True) -> dict:
    """Run ``num_requests`` requests in a pool of the bytes of ``pool_seqs`` full-context sequences
    in one pool; ``grouped``: one group per attention kind, else one group keeping every block;
    ``per_chunk``: the windowed groups take a prompt's blocks chunk by chunk, else all at admission."""
    layout = kv_layout([mc.attention_spec(i).sliding_window for i in range(mc.num_layers)], grouped)
    blocks_per_seq = -(-a.context // a.block_size)
    # Pages of layout.num_slots layers in the bytes of pool_seqs x blocks_per_seq blocks of all layers.
    num_pages = pool_seqs * blocks_per_seq * mc.num_layers // layout.num_slots + 1
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=a.context + a.block_size,
                             enable_chunked_prefill=True)
    bm = make_block_manager(layout, a.block_size, num_pages, 0, watermark=0.0,
                            max_num_batched_tokens=config.max_num_batched_tokens if per_chunk else None)
    clock = SimClock()
    setup = Setup("gemma3-shaped", mc, A100_40GB, 1, (num_pages - 1) * a.block_size)
    executor = SimulatedExecutor(CostModel(setup, a.block_size), clock)
    engine = LLMEngine.from_components(config, bm, executor, mc.vocab_size, clock=clock)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), None, params, rng.integers(3, mc.vocab_size, a.context - a.output_len).tolist())
    running, saturated, steps, last = [], [], 0, None
    while engine.has_unfinished_requests():
        rows_before = executor.stats.batched_seqs
        engine.step()
        steps += 1
        running.append(len(engine.scheduler.running))
        if engine.scheduler.waiting:  # memory-bound: requests wait for blocks
            saturated.append(running[-1])
        if executor.stats.batched_seqs - rows_before == num_requests:  # every request ran this step
            last = executor.stats.group_blocks
    bm.check_invariants()
    # The last step that ran every request: their contexts at the longest they share.
    per_group = last or [0]
    pages = sum(per_group)
    to_blocks = layout.num_slots / mc.num_layers  # one-pool blocks per page
    return dict(groups=layout.num_groups, pages=num_pages - 1, steps=steps, mean_running=float(np.mean(running)),
                mean_saturated=float(np.mean(saturated)) if saturated else float("nan"),
                peak_running=max(running), blocks_in_use=pages * to_blocks, per_group=per_group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pools", default="4,16", help="pool sizes, in one-pool sequences at full context")
    a = ap.parse_args()
    mc = gemma3_config(a.window, a.context)
    kinds = ["full" if mc.attention_spec(i).sliding_window is None else f"window {a.window}"
             for i in range(mc.num_layers)]
    print(f"Gemma 3-shaped model: {mc.num_layers} layers ({', '.join(kinds)}), contexts of {a.context} tokens "
          f"({a.context - a.output_len} prompt + {a.output_len} new), blocks of {a.block_size} tokens")

    pool = int(a.pools.split(",")[0])
    one, grouped = run(mc, a, False, pool, pool), run(mc, a, True, pool, pool)
    print(f"\n1. {pool} sequences together, KV in use at {a.context}-token contexts (in one-pool blocks of "
          f"{mc.num_layers} layers):")
    print(f"   one pool:          {one['blocks_in_use']:8.1f} blocks")
    print(f"   one pool per kind: {grouped['blocks_in_use']:8.1f} blocks  ({grouped['groups']} groups; pages held "
          f"per group {grouped['per_group']})")
    print(f"   ratio: {grouped['blocks_in_use'] / one['blocks_in_use']:.3f}x  (target <= 0.3x)")

    print(f"\n2. Pools of fixed bytes, {4}x the requests one pool holds: sequences running per step")
    print("   (mean: over every step; while waiting: over the steps where requests wait for blocks)")
    print(f"   {'pool (one-pool seqs)':>20} {'layout':>30} {'mean':>7} {'while waiting':>14} {'peak':>5} "
          f"{'steps':>6}")
    layouts = [("one pool", False, True), ("per kind, prompt at admission", True, False),
               ("per kind, chunk by chunk", True, True)]
    for pool in (int(p) for p in a.pools.split(",")):
        rows = [run(mc, a, grouped, pool, 4 * pool, per_chunk) for _, grouped, per_chunk in layouts]
        for r, (name, _, _) in zip(rows, layouts):
            print(f"   {pool:>20} {name:>30} {r['mean_running']:7.1f} {r['mean_saturated']:14.1f} "
                  f"{r['peak_running']:5d} {r['steps']:6d}")
        for r, (name, _, _) in zip(rows[1:], layouts[1:]):
            print(f"   {'ratio to one pool':>20} {name:>30} {r['mean_running'] / rows[0]['mean_running']:6.2f}x "
                  f"{r['mean_saturated'] / rows[0]['mean_saturated']:13.2f}x "
                  f"{r['peak_running'] / rows[0]['peak_running']:4.1f}x {r['steps'] / rows[0]['steps']:5.2f}x"
                  "  (target >= 3x)")


if __name__ == "__main__":
    main()
