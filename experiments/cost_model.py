"""A roofline model of one serving iteration's GPU time.

Every term is a rate times an amount, with the rates from :mod:`experiments.hardware`
(A100 data-sheet peaks scaled by an achieved fraction). For an iteration that
runs ``T`` tokens of ``S`` sequences on ``t`` tensor-parallel GPUs:

- **Linear layers** (QKV, output projection, MLP, LM head on the sampled rows):
  ``max(2 * T * params / (t * peak_flops * matmul_eff), weight_bytes / (t * hbm_bw * bw_eff))``
  -- compute-bound for big prefills, weight-read-bound for decodes.
- **Attention**: prefill FLOPs ``4 * layers * heads * head_dim * q * (c + (q + 1) / 2)``
  for ``q`` new tokens after ``c`` cached ones (causal), over the matmul rate;
  plus reading every cached K/V token (``kv_bytes_per_token`` each) over HBM.
  The paged kernel reads K/V block by block: its bandwidth is scaled by
  ``block_size / (block_size + paged_block_overhead)`` (4 tokens' worth of
  overhead per block puts block size 16 at 0.8 of a contiguous kernel, the
  paper's Fig. 18a: 20-26 % slower than FasterTransformer's kernel; block size 1
  is 5x slower). Baselines use the contiguous kernel (``paged=False``).
- **Tensor parallelism**: two all-reduces per layer of ``T * hidden * 2`` bytes,
  ring algorithm over NVLink, ``allreduce_latency`` each.
- **Swapping**: each swapped block is ``2 * layers`` copies (K and V of every
  layer, as vLLM's cache engine issues them) over PCIe, ``memcpy_latency`` each:
  small blocks pay the per-copy latency many times (Fig. 19a).
- **Copy-on-write**: a block copy reads and writes ``block_bytes`` in HBM.
- A fixed **per-iteration overhead** (scheduling, sampling, kernel launches) and
  a per-sequence one.

Terms are summed: the phases of a layer run one after another. The model is
documented, not fitted; ``step_overhead`` and the efficiencies are round numbers
in the range reported for A100 serving stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.hardware import Setup, num_params

DTYPE_BYTES = 2  # fp16 weights and KV cache


@dataclass(frozen=True)
class CostParams:
    step_overhead: float = 4e-3  # s per iteration
    seq_overhead: float = 20e-6  # s per sequence in the batch
    paged_block_overhead: float = 4.0  # tokens' worth of read time lost per KV block by the paged kernel
    allreduce_latency: float = 10e-6  # s per all-reduce
    memcpy_latency: float = 4e-6  # s per host<->device copy call


class CostModel:
    def __init__(self, setup: Setup, block_size: int, paged: bool = True, params: CostParams = CostParams()):
        self.setup, self.block_size, self.paged, self.p = setup, block_size, paged, params
        m, g, t = setup.model, setup.gpu, setup.num_gpus
        self.num_params = num_params(m)
        self.flops_rate = t * g.peak_flops * g.matmul_efficiency
        self.weight_time = self.num_params * DTYPE_BYTES / (t * g.hbm_bandwidth * g.bandwidth_efficiency)
        paged_eff = block_size / (block_size + params.paged_block_overhead) if paged else 1.0
        self.kv_read_rate = t * g.hbm_bandwidth * g.bandwidth_efficiency * paged_eff  # bytes/s
        self.kv_bytes_per_token = m.kv_bytes_per_token
        self.attn_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim
        self.layer_flops_per_token = 2 * (self.num_params - m.vocab_size * m.hidden_size)
        self.head_flops_per_row = 2 * m.vocab_size * m.hidden_size
        if t > 1:
            ring = 2 * (t - 1) / t / g.nvlink_bandwidth
            self.allreduce_per_token = 2 * m.num_layers * m.hidden_size * DTYPE_BYTES * ring
            self.allreduce_fixed = 2 * m.num_layers * params.allreduce_latency
        else:
            self.allreduce_per_token = self.allreduce_fixed = 0.0
        block_bytes = m.kv_bytes_per_token * block_size
        # Each GPU moves its shard over its own PCIe link: 2 * layers copies per block.
        self.swap_per_block = 2 * m.num_layers * params.memcpy_latency + block_bytes / t / g.pcie_bandwidth
        self.copy_per_block = 2 * block_bytes / t / (g.hbm_bandwidth * g.bandwidth_efficiency)

    def step_time(self, rows: list[tuple[int, int]], num_sampled: int, num_swapped_blocks: int = 0,
                  num_copied_blocks: int = 0) -> float:
        """Seconds for one iteration. ``rows``: (new tokens, cached tokens before them) per
        sequence; ``num_sampled``: rows that produce a token (LM head)."""
        p = self.p
        time = p.step_overhead + num_swapped_blocks * self.swap_per_block + num_copied_blocks * self.copy_per_block
        if not rows:
            return time
        num_tokens = 0
        pairs = 0.0  # query-key pairs computed
        kv_read = 0  # cached tokens read
        for q, c in rows:
            num_tokens += q
            kv_read += c
            if q > 1:
                pairs += q * (c + (q + 1) / 2)
            else:
                kv_read += 1
        linear_flops = num_tokens * self.layer_flops_per_token + num_sampled * self.head_flops_per_row
        time += max(linear_flops / self.flops_rate, self.weight_time)
        time += pairs * self.attn_flops_per_pair / self.flops_rate + kv_read * self.kv_bytes_per_token / self.kv_read_rate
        time += self.allreduce_fixed + num_tokens * self.allreduce_per_token
        return time + len(rows) * p.seq_overhead

    def swap_time_per_block(self) -> float:
        return self.swap_per_block

    def recompute_time_per_block(self, context: int = 512) -> float:
        """Marginal prefill time of one block's tokens recomputed after ``context`` others
        (compute-bound: a recomputed prompt is long)."""
        q, c = self.block_size, context
        flops = q * self.layer_flops_per_token + q * (c + (q + 1) / 2) * self.attn_flops_per_pair
        return flops / self.flops_rate + q * self.allreduce_per_token
