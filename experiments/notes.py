"""Text of paper_figures/README.md (the method, then one note per figure)."""

INTRO = """
# Paper figures, reproduced with the paged-jax simulator

There is no GPU here, so these figures come from a simulator in which **paged-jax's own engine,
scheduler and block manager make every decision** (`LLMEngine.from_components` with
`experiments/sim_executor.py`): admission, batching, block allocation, copy-on-write, preemption,
swapping. Only the model's step time is modelled, by the roofline in `experiments/cost_model.py`
(A100 peaks from the data sheet at 50 % of peak FLOP/s and 70 % of peak HBM bandwidth, weights and
K/V reads over HBM, attention FLOPs, tensor-parallel all-reduces over NVLink, swaps over PCIe with a
per-copy latency, 4 ms per iteration and 20 us per sequence of overhead). Model shapes, GPU counts
and KV-cache slots are the paper's Table 1 (`experiments/hardware.py`).

The baselines are policies of the same scheduler and block manager (`SchedulerConfig`):
Orca(Max / Pow2 / Oracle) reserve 2048 tokens / prompt + next power of two of the output / prompt +
output at admission, rounded up to a power of two (buddy allocator); FasterTransformer reserves 2048
tokens per request and batches statically (a new batch starts only when the last one is done, and
returns its outputs together).
Baselines use a contiguous attention kernel; paged-jax pays the paged kernel's cost (0.8x the
bandwidth at block size 16, as in the paper's Fig. 18a).

Workloads are synthetic (`experiments/workloads.py`): log-normal input/output lengths calibrated
to the published means (ShareGPT 161.31 / 337.99, Alpaca 19.31 / 58.45 tokens; input + output <
2048), Poisson arrivals. Traces are shorter than the paper's hour (see the CSVs' `num_requests`);
the first 10 % of each trace is not measured.

**Sustainable request rate** is measured directly as the rate at which a system completes requests
when all of them are already waiting (`saturation_throughput`, between the 10th and 90th percentile
of completions) -- the knee of each latency curve. The latency curves are then drawn at rates
around each system's own knee. Ratios of these capacities are the "x times the request rate" numbers.
**Bands.** Where the paper gives a range (Fig. 12's 1.7-2.7x, 2.7-8x), that range is the band.
Where it gives a single value, the band is this project's choice: +-25 % around
each Fig. 2 share, 0.5-2x around each Fig. 15 bar (the saving depends on lengths and branching that
synthetic traces only approximate), 11-33x for FasterTransformer's "up to 22x", and the bands shown
in the table for the others. A verdict "in band" is only as strong as its band.
"""

FIGURE_NOTES = {
    "2": """
**Fig. 2 -- KV memory breakdown** (`fig2_memory_breakdown.png/.csv`). OPT-13B, ShareGPT at 4 req/s
(above every system's capacity), sampled every 10 iterations while requests queue. Token states =
tokens in the cache; reservation = reserved slots that later tokens of the request will fill;
internal fragmentation = reserved slots past the request's final length (for paged-jax: the empty
tail of each last block); external fragmentation & other = buddy rounding and free slots.""",
    "12": """
**Fig. 12 -- normalized latency vs request rate** (`fig12_latency.png`, `fig12_latency.csv`,
`fig12_capacity.csv`). OPT-13B (1 GPU), OPT-66B (4), OPT-175B (8 x 80 GB) on ShareGPT and Alpaca.
Normalized latency = mean of latency / output length.""",
    "13": """
**Fig. 13 -- average batched requests** (`fig13_batched_requests.png/.csv`). OPT-13B, ShareGPT at
2 req/s and Alpaca at 30 req/s; requests in an iteration's batch, averaged over the iterations
between the warm-up and the last arrival. Where the simulator's iteration is faster than the 2023
vLLM's (Alpaca: the paper's 132 batched requests at 30 req/s imply about 75 ms per iteration by
Little's law, our roofline gives about 35 ms), fewer requests are in flight at the same rate.""",
    "14": """
**Fig. 14 -- parallel sampling and beam search** (`fig14_parallel_sampling_beam.png`,
`fig14_*.csv`). OPT-13B, Alpaca, n = 2, 4, 6 samples (`SamplingParams(n=n, best_of=n)`: the real
engine forks the samples, which share the prompt's blocks) and beam width 2, 4, 6. Beams run the
engine's own beam search over synthetic next-token scores (`experiments/sim_executor.py`:
exponential gaps of mean 1 nat between a beam's successive candidates, chosen before comparing with
the paper): dropped beams are freed, chosen ones forked. Orca(Oracle) cannot share: each sample or beam is its own request with its own
reservation.""",
    "15": """
**Fig. 15 -- memory saved by sharing** (`fig15_memory_saving.png/.csv`). 1 - (device blocks in
use) / (blocks summed over every sequence's block table), averaged before the last arrival, at
OPT-13B's Fig. 13 rates (above capacity for widths >= 2).""",
    "16": """
**Fig. 16 -- shared prefix** (`fig16_shared_prefix.png`, `fig16_*.csv`). LLaMA-13B, translation
requests (synthetic WMT16-like lengths) behind a 1-shot (80-token) or 5-shot (341-token) prefix.
paged-jax computes the prefix once (`LLMEngine.add_prefix`) and every request maps its blocks;
Orca(Oracle) stores and computes it per request.""",
    "17": """
**Fig. 17 -- chatbot** (`fig17_chatbot.png`, `fig17_*.csv`). OPT-13B; the prompt is the chat
history (a Poisson(2) number of earlier ShareGPT turns plus the new input) cut to its last 1024
tokens; replies are ShareGPT outputs capped at 1024 tokens.""",
    "18b": """
**Fig. 18b -- block size** (`fig18b_block_size.png/.csv`). OPT-13B, paged-jax at 0.9x its
capacity at block size 16. Small blocks lose attention bandwidth (per-block overhead of the paged
kernel); large blocks waste memory in partly filled last blocks, so fewer requests fit.""",
    "19": """
**Fig. 19 -- recompute vs swap** (`fig19_recompute_vs_swap.png`, `fig19a_per_block_cost.csv`,
`fig19b_recompute_vs_swap.csv`). (a) from the cost model, the time to swap or to recompute the
same 256 tokens of K/V at each block size: a block's swap is 2 x 40 copy calls (K and V of every
layer) over PCIe, so small blocks pay the per-call latency many times; recomputing costs the same
at any block size. (b) OPT-13B, ShareGPT at paged-jax's
capacity, preemption mode forced to recompute or swap.""",
    "kv8": """
**Beyond the paper -- an 8-bit KV cache** (`figkv8_latency.png`, `figkv8_capacity.csv`,
`figkv8_latency.csv`). OPT-13B on ShareGPT, paged-jax with `kv_cache_dtype="int8"` (one byte per value,
a float16 scale per token and head) against the paper's 16-bit cache in the same memory: 1.97x the
KV slots, and half the K/V bytes read per step. Dequantizing is not charged (a GPU kernel does it in
registers while it waits on memory).""",
}
