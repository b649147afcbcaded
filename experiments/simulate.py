"""Run a request trace through the real engine with the simulated executor.

The systems compared in the paper are scheduling policies of the ONE scheduler
and block manager (see :mod:`paged_jax.policy`):

- ``vllm``: paged KV cache, blocks allocated on demand, the paged attention kernel.
- ``orca-max`` / ``orca-pow2`` / ``orca-oracle``: KV space reserved at admission
  (2048 tokens / prompt + next power of two of the output / prompt + output),
  rounded up to a power of two by a buddy allocator; contiguous attention kernel.
  Samples of a request do not share memory: a request of ``n`` samples is ``n``
  requests (its latency is that of its last one).
- ``ft`` (FasterTransformer): the ``orca-max`` reservation with static batching; a batch's
  outputs are returned together when its last request ends.

:func:`run_trace` drives ``LLMEngine.step()`` on a simulated clock: requests are
added when the clock reaches their arrival; finishing times give latencies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from paged_jax.engine import LLMEngine
from paged_jax.memory.block_manager import BlockManager
from paged_jax.sampling_params import SamplingParams
from paged_jax.policy import FCFS, FasterTransformer, Orca
from paged_jax.scheduler import SchedulerConfig
from paged_jax.sequence import SequenceStatus

from experiments.cost_model import CostModel, CostParams
from experiments.hardware import Setup
from experiments.sim_executor import SimClock, SimulatedExecutor
from experiments.workloads import Request

logging.getLogger("paged_jax").setLevel(logging.ERROR)  # preemption warnings are expected here

SYSTEMS = {  # each system's scheduling policy (policies hold no state: one instance serves every run)
    "vllm": FCFS(),
    "orca-oracle": Orca("oracle", buddy_allocator=True),
    "orca-pow2": Orca("pow2", buddy_allocator=True),
    "orca-max": Orca("max", buddy_allocator=True),
    "ft": FasterTransformer("max", buddy_allocator=True),
}
LABELS = {"vllm": "vLLM (paged-jax)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
          "orca-max": "Orca (Max)", "ft": "FasterTransformer"}


@dataclass
class TraceResult:
    system: str
    rate: float
    latencies: np.ndarray  # end-to-end seconds per measured request
    output_lens: np.ndarray
    sim_time: float  # simulated seconds until the last request finished
    num_steps: int
    avg_batched_requests: float  # per iteration, between the warmup and the last arrival
    num_preemptions: dict
    swapped_blocks: int
    wall_time: float
    num_ignored: int = 0
    memory: dict = field(default_factory=dict)  # averages of the sampled memory breakdown

    @property
    def normalized_latency(self) -> float:
        """Mean over requests of latency / output length (s/token), the paper's metric."""
        return float(np.mean(self.latencies / self.output_lens)) if len(self.latencies) else float("nan")

    @property
    def throughput(self) -> float:
        """Requests per simulated second."""
        return len(self.latencies) / self.sim_time if self.sim_time else 0.0


def build_engine(setup: Setup, system: str, block_size: int = 16, preemption_mode: Optional[str] = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2560, max_model_len: int = 2048,
                 cost_params: CostParams = CostParams(), beam_gap: float = 1.0, enable_chunked_prefill: bool = False,
                 target_itl_ms: Optional[float] = None) -> tuple[LLMEngine, SimulatedExecutor, SimClock]:
    """The real engine over the simulated executor. The paper's systems run whole prompts
    (``enable_chunked_prefill=False``); with ``target_itl_ms`` (chunked prefill on) the scheduler
    sizes chunks by :class:`paged_jax.step_cost.StepCostModel`, the real engine's model, fitted
    online from the simulated step times."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {sorted(SYSTEMS)}")
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode,
                             enable_chunked_prefill=enable_chunked_prefill, policy=SYSTEMS[system],
                             target_itl_ms=target_itl_ms)
    bm = BlockManager(block_size, setup.num_gpu_blocks(block_size), setup.num_cpu_blocks(block_size))
    clock = SimClock()
    executor = SimulatedExecutor(CostModel(setup, block_size, paged=system == "vllm", params=cost_params), clock,
                                 beam_gap=beam_gap)
    engine = LLMEngine.from_components(config, bm, executor, setup.model.vocab_size, clock=clock)
    return engine, executor, clock


def _prompt_tokens(req: Request, index: int, vocab: int) -> list[int]:
    """Prompt token ids: the shared prefix (same ids in every request), then ids unique to the request."""
    base = 1000 + (index * 7919) % (vocab - 3000)
    return list(range(100, 100 + req.prefix_len)) + [base + j % 1000 for j in range(req.prompt_len - req.prefix_len)]


def run_trace(setup: Setup, system: str, requests: list[Request], rate: float = 0.0, warmup: float = 0.0,
              sample_every: int = 0, on_sample: Optional[Callable] = None, max_sim_time: float = float("inf"),
              beam_gap: float = 1.0, **engine_kwargs) -> TraceResult:
    """Simulate ``requests``. Requests arriving before ``warmup`` seconds are not measured.
    Every ``sample_every`` steps before the last arrival, ``on_sample(engine)`` returns a dict
    of numbers to average (or None to skip).
    A run whose simulated time passes ``max_sim_time`` stops there (unfinished requests are
    then counted with the latency they have so far: a lower bound). Beam search requests run the
    engine's beam search over the executor's synthetic candidates (``beam_gap``, see
    :mod:`experiments.sim_executor`) where blocks are shared."""
    engine, executor, clock = build_engine(setup, system, beam_gap=beam_gap, **engine_kwargs)
    expand = isinstance(SYSTEMS[system], Orca)  # reservations share nothing: one request per sample
    if any(r.prefix_len for r in requests) and system == "vllm":
        _pin_prefix(engine, requests[0], setup.model.vocab_size)
    t0 = time.perf_counter()
    pending = sorted(requests, key=lambda r: r.arrival)
    groups: dict[str, list[str]] = {}  # request -> engine request ids
    arrival: dict[str, float] = {}
    finish: dict[str, float] = {}
    # Static batching returns a batch's outputs together, when its last request ends.
    static = isinstance(SYSTEMS[system], FasterTransformer)
    batch_done: list[str] = []
    samples: list[dict] = []
    ignored = 0
    vocab = setup.model.vocab_size
    i = 0
    clock.now = pending[0].arrival if pending else 0.0
    last_arrival = pending[-1].arrival if pending else 0.0
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival <= clock.now:
            _add(engine, pending[i], str(i), vocab, expand, groups)
            arrival[str(i)] = pending[i].arrival
            i += 1
        if not engine.has_unfinished_requests():
            clock.now = pending[i].arrival
            continue
        if clock.now > max_sim_time:
            break
        executor.measuring = warmup <= clock.now <= last_arrival
        for out in engine.step():
            if out.finished:
                finish[out.request_id] = clock.now
                batch_done.append(out.request_id)
                ignored += out.finish_message is not None
        if static and not engine.scheduler.running:
            finish.update((rid, clock.now) for rid in batch_done)
        if not static or not engine.scheduler.running:
            batch_done.clear()
        if sample_every and on_sample is not None and executor.stats.num_steps % sample_every == 0 \
                and i < len(pending):  # not in the drain after the last arrival
            sample = on_sample(engine)
            if sample is not None:
                samples.append(sample)
    lat, lens = [], []
    for rid, ids in groups.items():
        if arrival[rid] < warmup:
            continue
        ends = [finish.get(x, clock.now) for x in ids]
        lat.append(max(ends) - arrival[rid])
        lens.append(pending[int(rid)].output_len)
    st = executor.stats
    memory = {k: float(np.mean([s[k] for s in samples])) for k in samples[0]} if samples else {}
    return TraceResult(system, rate, np.array(lat), np.array(lens, dtype=float), clock.now, st.num_steps,
                       st.batched_requests / max(1, st.measured_steps), dict(engine.scheduler.num_preemptions),
                       st.swapped_blocks, time.perf_counter() - t0, ignored, memory)


def _add(engine: LLMEngine, req: Request, rid: str, vocab: int, expand: bool, groups: dict) -> None:
    tokens = _prompt_tokens(req, int(rid), vocab)
    width = max(req.n, req.beam_width)
    if expand and width > 1:
        ids = [f"{rid}.{k}" for k in range(width)]
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
    else:
        ids = [rid]
        beam = req.beam_width > 1
        params = SamplingParams(n=width, best_of=width, max_tokens=req.output_len, ignore_eos=True,
                                use_beam_search=beam, temperature=0 if beam else 1.0)
    for x in ids:
        engine.add_request(x, None, params, prompt_token_ids=tokens, arrival_time=req.arrival)
    groups[rid] = ids


def _pin_prefix(engine: LLMEngine, req: Request, vocab: int) -> None:
    """vLLM computes the shared prefix once and keeps its blocks (paper Sec. 4.4)."""
    engine.add_prefix(prompt_token_ids=_prompt_tokens(req, 0, vocab)[:req.prefix_len])


# ---- memory accounting -------------------------------------------------------------
def memory_breakdown(engine: LLMEngine) -> Optional[dict]:
    """Shares of the KV pool (Fig. 2): token states, reserved for tokens still to come,
    reserved but never used (internal fragmentation: reservation past the final length,
    or the empty tail of the last block), and the rest (buddy rounding, free slots).
    None while no request waits: memory is the limit only under load."""
    bm, sched = engine.block_manager, engine.scheduler
    if not sched.waiting:
        return None
    bs = bm.block_size
    total = bm.gpu_allocator.num_total_blocks * bs
    tokens = reserved = internal = 0
    for group in sched.running:
        asked, _ = sched.reservation(group)
        final = group.seqs[0].get_prompt_len() + group.sampling_params.max_tokens
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            slots = len(bm.get_block_table(seq)) * bs
            n = seq.get_len()
            tokens += n
            if asked:
                reserved += max(0, min(asked, final) - n)
                internal += max(0, asked - final)
            else:
                internal += slots - n
    return {"token_states": tokens / total, "reservation": reserved / total, "internal_frag": internal / total,
            "external_frag_other": 1.0 - (tokens + reserved + internal) / total}


def sharing_savings(engine: LLMEngine) -> Optional[dict]:
    """Blocks saved by sharing: 1 - distinct device blocks / blocks summed over tables (Fig. 15).
    None while nothing runs."""
    bm = engine.block_manager
    if not engine.scheduler.running:
        return None
    per_table = sum(len(bm.get_block_table(s)) for g in engine.scheduler.running
                    for s in g.get_seqs(SequenceStatus.RUNNING))
    used = bm.gpu_allocator.num_used_blocks
    return {"blocks_per_table_sum": per_table, "blocks_used": used}


def sustainable_rate(rates: list[float], latencies: list[float], threshold: float) -> float:
    """Highest request rate whose normalized latency stays under ``threshold``, interpolated
    linearly between measured rates (the last measured rate if it never crosses; 0 if the
    lowest already does)."""
    pts = sorted(zip(rates, latencies))
    if not pts or pts[0][1] > threshold:
        return 0.0
    for (r0, l0), (r1, l1) in zip(pts, pts[1:]):
        if l1 > threshold:
            return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
    return pts[-1][0]


def saturation_throughput(setup: Setup, system: str, requests: list[Request], **kwargs) -> tuple[float, TraceResult]:
    """Requests per second a system completes when every request is already waiting: its
    capacity, the highest request rate it can sustain. All requests arrive at time 0; the
    rate is measured between the 10th and the 90th percentile of completions (the ramp-up
    and the drain left out)."""
    burst = [Request(0.0, r.prompt_len, r.output_len, r.n, r.beam_width, r.prefix_len) for r in requests]
    res = run_trace(setup, system, burst, **kwargs)
    ends = np.sort(res.latencies)  # arrival 0: latency = completion time
    lo, hi = int(0.1 * len(ends)), int(0.9 * len(ends))
    if hi <= lo or ends[hi] <= ends[lo]:
        return float("nan"), res
    return (hi - lo) / (ends[hi] - ends[lo]), res
