"""Beyond the paper: an 8-bit KV cache. OPT-13B on ShareGPT with paged-jax's ``kv_cache_dtype="int8"``
(one byte per value and a float16 scale per token and head) against the paper's 16-bit cache, in the
same memory, with the real scheduler and block manager (``experiments/simulate.py``).

The cost model reads the smaller K/V (the attention's memory traffic halves, near enough) and
counts the larger pool (``hardware.with_kv_cache``); it charges nothing for dequantizing, which a
GPU kernel does in registers while it waits on memory.
"""

from __future__ import annotations

from experiments.fig_serving import capacities, latency_curves
from experiments.runner import Context, pyplot, ratio, write_csv

SETUPS = [("opt-13b", "16-bit KV (the paper's)"), ("opt-13b-kv8", "8-bit KV (kv_cache_dtype='int8')")]


def figkv8(ctx: Context) -> None:
    panels = [(setup, "sharegpt") for setup, _ in SETUPS]
    caps, cap_rows = capacities(ctx, panels, ["vllm"])
    write_csv(ctx.path("figkv8_capacity.csv"), cap_rows)
    rows = latency_curves(ctx, caps, "kv8 curves")
    write_csv(ctx.path("figkv8_latency.csv"), rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    for setup, label in SETUPS:
        pts = sorted((r["rate"], r["normalized_latency"]) for r in rows if r["setup"] == setup)
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=label)
    ax.set_title("OPT-13B, ShareGPT: 8-bit vs 16-bit KV cache", fontsize=10)
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel("Normalized latency (s/token)")
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ctx.path("figkv8_latency.png"), dpi=120)
    plt.close(fig)
    from experiments.hardware import get_setup

    slots = [get_setup(setup).kv_slots for setup, _ in SETUPS]
    ctx.headline("kv8", "OPT-13B ShareGPT: sustainable rate, 8-bit KV / 16-bit KV", "not in the paper",
                 ratio(caps[("opt-13b-kv8", "sharegpt", "vllm")], caps[("opt-13b", "sharegpt", "vllm")]), None,
                 f"the same memory holds {slots[1]:,} tokens instead of {slots[0]:,} ({slots[1] / slots[0]:.2f}x); "
                 "the rate grows less: more requests in a batch make each step longer, and the trace's "
                 "long requests are the same")
