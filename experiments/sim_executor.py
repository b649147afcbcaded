"""The simulated executor: the model runner's interface, a cost model instead of a GPU.

An :class:`paged_jax.executor.interface.Executor` like
:class:`paged_jax.executor.model_runner.ModelRunner`: every row gets the samples
the engine asks for (``best_of`` for a request's first token), so the real engine
appends tokens, forks samples, checks stop rules and frees blocks exactly as it
does with a model. Nothing here imports JAX. Token ids carry no meaning (output
lengths are fixed in advance with ``max_tokens`` and ``ignore_eos``); the step's
duration comes from :class:`experiments.cost_model.CostModel` and advances a
:class:`SimClock`.

Beam search runs through the engine's own beam search (``use_beam_search``): a
row asking for candidates gets synthetic ones, and the engine keeps, forks and frees beams
through the block manager as it does with a model. The candidates are the one
modelling choice: the gaps between a beam's successive next-token logprobs are
exponential with mean ``beam_gap`` nats (default 1: a second choice on average e
times less likely than the first). Smaller gaps keep beams apart longer; larger
gaps let the best beam take over (more sharing).

Memory is counted per layer group (``paged_jax.memory.layer_groups``): each step records the
device blocks the scheduled rows' tables hold in each group (one group for a model of one
attention kind), and the peak of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from paged_jax.executor.interface import RowSampling, Sample, StepResult, check_sampling
from paged_jax.memory.block_allocator import NULL_BLOCK
from paged_jax.scheduler import SchedulerOutput

from experiments.cost_model import CostModel

TOKEN_ID = 7  # any id: generation ignores EOS and stops at max_tokens
BEAM_TOKEN_BASE = 1000  # a beam's candidates are ids 1000, 1001, ... (distinct, none a stop token)


class SimClock:
    """Simulated seconds; call it for the current time."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class StepStats:
    """Running totals over the executed iterations."""

    num_steps: int = 0
    busy_time: float = 0.0
    measured_steps: int = 0  # steps taken while ``SimulatedExecutor.measuring`` was on
    batched_requests: int = 0  # sum over measured steps of distinct requests in the batch
    batched_seqs: int = 0
    batched_tokens: int = 0
    swapped_blocks: int = 0
    copied_blocks: int = 0
    recorded: list = field(default_factory=list)
    # Per layer group: device blocks the last step's rows held, and the most any step's held.
    group_blocks: list = field(default_factory=list)
    peak_group_blocks: list = field(default_factory=list)


class SimulatedExecutor:
    def __init__(self, cost_model: CostModel, clock: SimClock, beam_gap: float = 1.0, seed: int = 0):
        if not beam_gap > 0:
            raise ValueError(f"beam_gap must be > 0 nats, got {beam_gap!r}")
        self.cost_model = cost_model
        self.clock = clock
        self.beam_gap = beam_gap
        self.rng = np.random.default_rng(seed)
        self.stats = StepStats()
        self.measuring = True  # count batch sizes (the driver turns it off outside its window)
        self._sample = Sample(TOKEN_ID, 0.0, None)
        self.timings: dict[str, float] = {}  # no phases worth timing: the duration is simulated

    @property
    def num_compilations(self) -> int:
        return 0  # nothing compiles

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, sampling_params=None,
                eos_token_id: Optional[int] = None, progress: bool = True) -> int:
        return 0  # nothing to compile

    def _beam_sample(self, num: int) -> Sample:
        lps = -np.cumsum(self.rng.exponential(self.beam_gap, num))
        ids = list(range(BEAM_TOKEN_BASE, BEAM_TOKEN_BASE + num))
        return Sample(ids[0], float(lps[0]), None, (ids, lps.tolist()))

    def execute(self, out: SchedulerOutput, sampling: Sequence[RowSampling] = (),
                eos_token_id: Optional[int] = None) -> StepResult:
        check_sampling(out, sampling)
        result = StepResult()
        rows = []
        groups = set()
        for i, (r, spec) in enumerate(zip(out.scheduled, sampling)):
            rows.append((r.num_tokens, r.seq.num_computed_tokens))
            groups.add(id(r.group))
            if spec.num_candidates:
                result.samples[i] = [self._beam_sample(spec.num_candidates) for _ in spec.seeds]
            elif spec.seeds:
                result.samples[i] = [self._sample] * spec.num_samples
        swapped = len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)
        copied = len(out.blocks_to_copy)
        num_sampled = sum(len(v) for v in result.samples.values())
        duration = self.cost_model.step_time(rows, num_sampled, swapped, copied)
        self.clock.now += duration
        s = self.stats
        s.num_steps += 1
        s.busy_time += duration
        if self.measuring:
            s.measured_steps += 1
            s.batched_requests += len(groups)
            s.batched_seqs += len(rows)
            s.batched_tokens += sum(q for q, _ in rows)
        s.swapped_blocks += swapped
        s.copied_blocks += copied
        s.group_blocks = group_blocks(out)
        s.peak_group_blocks = [max(a, b) for a, b in zip(s.group_blocks, s.peak_group_blocks)] or list(s.group_blocks)
        return result


def group_blocks(out: SchedulerOutput) -> list[int]:
    """Distinct device blocks the scheduled rows' tables hold, per layer group (a shared block once;
    the null block of entries a sliding window freed not at all)."""
    per_group: list[set[int]] = []
    for r in out.scheduled:
        tables = getattr(r.block_table, "per_group", [r.block_table])
        per_group += [set() for _ in range(len(tables) - len(per_group))]
        for held, table in zip(per_group, tables):
            held.update(table)
    return [len(held - {NULL_BLOCK}) for held in per_group]
