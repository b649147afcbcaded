"""The executor border, in plain Python (no JAX): what the engine asks an executor for
and what it gets back.

The engine decides what each scheduled row's samples mean: how many to draw (``best_of``
on a request's first token, otherwise one), their seeds (:func:`paged_jax.seeds.seed_for_sample`),
how many top candidates a beam needs, which rows want logprobs and prompt logprobs. It hands
the executor one :class:`RowSampling` per scheduled row, plain data; the executor runs the
cache operations and the forward pass, draws exactly what it was asked for, and returns a
:class:`StepResult`. Executors: :class:`paged_jax.executor.model_runner.ModelRunner` (JAX) and
``experiments.sim_executor.SimulatedExecutor`` (a cost model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, Union, runtime_checkable

if TYPE_CHECKING:
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.scheduler import SchedulerOutput


@dataclass(frozen=True)
class RowSampling:
    """What one scheduled row asks of the sampler (the same index as ``SchedulerOutput.scheduled``)."""

    params: "SamplingParams"  # temperature, penalties, top-k/p, min-p, min_tokens, stop ids
    # One seed per sample to draw (None: an unseeded draw); empty: the row draws nothing
    # (its chunk does not complete its sequence).
    seeds: tuple[Optional[int], ...] = ()
    logprobs: Optional[int] = None  # the top-N logprobs entry of each sample, when wanted
    num_candidates: int = 0  # > 0: each sample carries its best next tokens and logprobs (beam search)
    prompt_logprobs: Optional[int] = None  # the top-N entries of the prompt tokens this row runs, when wanted
    # Speculative decoding: the row's last n tokens (and its sequence's last n output tokens) are draft
    # tokens. It then gets n + 1 samples, one drawn at each of its last n + 1 positions as plain decoding
    # would draw there (the output before that position as history; its one seed), in position order.
    num_speculative_tokens: int = 0
    # Each sample also carries the distribution it was drawn from (``Sample.probs``): speculative
    # decoding's sampled drafts keep the draft model's q and verify them against the target's p.
    return_probs: bool = False

    def __post_init__(self):
        if self.num_candidates < 0:
            raise ValueError(f"num_candidates must be >= 0, got {self.num_candidates!r}")
        if self.num_speculative_tokens < 0 or (self.num_speculative_tokens and len(self.seeds) != 1):
            raise ValueError(f"num_speculative_tokens must be >= 0, and a row with drafts draws one sample per "
                             f"position (one seed): got {self.num_speculative_tokens!r} with {len(self.seeds)} seeds")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs!r}")

    @property
    def num_samples(self) -> int:
        return len(self.seeds)

    @property
    def num_top(self) -> int:
        """The top-N width the sampler must return for this row."""
        return max(self.logprobs or 0, self.num_candidates)


@dataclass
class Sample:
    token_id: int
    logprob: float
    logprobs: Optional[dict[int, float]]  # the top-N entry, when the request asked for logprobs
    # Rows asking for candidates (beam search): the best next tokens and their logprobs, best
    # first (see paged_jax/beam_search.py).
    candidates: Optional[tuple[list[int], list[float]]] = None
    # Rows asking ``return_probs``: float32[V], the processed distribution (after penalties, temperature,
    # top-k, top-p, min-p) this sample was drawn from.
    probs: Optional[Any] = None


@dataclass
class StepResult:
    """Per scheduled row index: its samples (rows that asked for some), its prompt logprobs."""

    samples: dict[int, list[Sample]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)


@runtime_checkable
class Executor(Protocol):
    """What the engine calls. ``timings``: seconds spent by phase (shown in ``get_stats``);
    ``num_compilations``: compiled shapes so far (0 where nothing compiles)."""

    timings: dict[str, float]

    @property
    def num_compilations(self) -> int: ...

    def execute(self, out: "SchedulerOutput", sampling: Sequence[RowSampling] = (),
                eos_token_id: Optional[int] = None) -> StepResult:
        """Run ``out``'s cache operations and, for its scheduled rows, the forward pass; draw
        the samples ``sampling[i]`` asks of row ``i`` (one entry per scheduled row)."""
        ...

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                sampling_params: Union[None, "SamplingParams", list["SamplingParams"]] = None,
                eos_token_id: Optional[int] = None, progress: bool = True) -> int:
        """Prepare (compile) ahead of the first request; returns the number of shapes prepared."""
        ...


def position_histories(output_token_ids: list[int], num_drafts: int) -> list[list[int]]:
    """A row with ``num_speculative_tokens`` drafts: the output tokens before each of its
    ``num_drafts + 1`` scored positions (its output's last ``num_drafts`` tokens are the drafts), what
    plain decoding had generated when it drew the token at that position (the history penalties and
    ``min_tokens`` read; its length is the seeded key's offset)."""
    n = len(output_token_ids) - num_drafts
    return [output_token_ids[:n + j] for j in range(num_drafts + 1)]


def check_sampling(out: "SchedulerOutput", sampling: Sequence[RowSampling]) -> None:
    """An executor's check that the engine gave one :class:`RowSampling` per scheduled row."""
    if len(sampling) != len(out.scheduled):
        raise ValueError(f"sampling must hold one RowSampling per scheduled row: got {len(sampling)} "
                         f"for {len(out.scheduled)} rows")
