"""Sequences and sequence groups: the engine's plain-Python view of a request.

A *sequence* is one stream of tokens (prompt + generated tokens) with its own
block table in the block manager. A *sequence group* is everything one request
owns: the ``n`` / ``best_of`` samples or the beams of a beam search. Groups are
scheduled, preempted, swapped and freed as a whole.

No JAX here: everything above the executor is plain Python (see DESIGN.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from paged_jax.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "ignored"  # rejected before running (too long, can never fit)

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> Optional[str]:
        # vLLM reports an ignored (over-long) prompt with finish reason "length".
        if self is SequenceStatus.FINISHED_IGNORED:
            return "length"
        return self.value if self.is_finished else None


@dataclass
class Sequence:
    """One token stream. ``num_computed_tokens`` counts tokens whose K/V are in
    the cache; the tokens after it are what the next step must run."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    output_logprobs: list[Any] = field(default_factory=list)
    output_text: str = ""
    num_computed_tokens: int = 0
    sample_index: int = 0  # which of the request's samples this is (seeds sample i independently)
    stop_reason: Optional[Any] = None
    beam_score: Optional[float] = None  # a finished beam-search hypothesis: its length-penalised score
    # Structured output: this sequence's position in its grammar (a structured_output SequenceMatcher).
    # Its tokens survive preemption (recompute reruns them), so it is only ever advanced.
    matcher: Any = None
    # Incremental detokenizer offsets into get_token_ids() (set by the engine).
    prefix_offset: int = 0
    read_offset: int = 0

    # ---- lengths and tokens -------------------------------------------------
    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def append_token_id(self, token_id: int, logprob: float = 0.0, logprobs: Any = None) -> None:
        self.output_token_ids.append(int(token_id))
        self.cumulative_logprob += float(logprob)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: the cache is dropped, every token reruns."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, new_seq_id: int, sample_index: int = 0) -> "Sequence":
        return Sequence(
            seq_id=new_seq_id,
            prompt_token_ids=self.prompt_token_ids,  # never mutated: safe to share
            output_token_ids=list(self.output_token_ids),
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
            output_logprobs=list(self.output_logprobs),
            output_text=self.output_text,
            num_computed_tokens=self.num_computed_tokens,
            sample_index=sample_index,
            matcher=None if self.matcher is None else self.matcher.fork(),
            prefix_offset=self.prefix_offset,
            read_offset=self.read_offset,
        )


@dataclass
class SequenceGroup:
    """A request: one or more sequences sharing a prompt and sampling params."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    prompt: Optional[str] = None
    # Set when the group is rejected or otherwise ends outside the normal path.
    finish_message: Optional[str] = None
    beam: Any = None  # a beam_search.BeamState for beam-search requests

    def __post_init__(self):
        if not isinstance(self.sampling_params, SamplingParams):
            raise TypeError(f"request {self.request_id!r}: sampling_params must be a SamplingParams, "
                            f"got {type(self.sampling_params).__name__}")

    def get_seqs(self, status: Optional[SequenceStatus] = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def num_seqs(self, status: Optional[SequenceStatus] = None) -> int:
        return len(self.get_seqs(status))

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def find(self, seq_id: int) -> Sequence:
        for s in self.seqs:
            if s.seq_id == seq_id:
                return s
        raise KeyError(f"sequence {seq_id} is not in request {self.request_id!r}")

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def remove(self, seq_id: int) -> None:
        self.seqs = [s for s in self.seqs if s.seq_id != seq_id]
