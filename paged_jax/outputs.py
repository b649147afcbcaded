"""What ``LLM.generate`` / ``LLMEngine.step`` hand back, shaped like vLLM v0.2.x.

Logprobs format (vLLM 0.2): ``CompletionOutput.logprobs`` is ``None`` unless the
request asked for them; otherwise a list with one entry per generated token,
each a ``dict[token_id, logprob]`` holding the top-N tokens plus the sampled
token (so N or N + 1 entries). ``RequestOutput.prompt_logprobs`` is the same
per prompt token, with ``None`` for the first prompt token (nothing predicts it).

No JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from paged_jax.sequence import SequenceGroup

SampleLogprobs = list[dict[int, float]]
PromptLogprobs = list[Optional[dict[int, float]]]


def make_logprobs_dict(
    token_id: int,
    logprob: float,
    top_token_ids: Sequence[int] = (),
    top_logprobs: Sequence[float] = (),
    num: Optional[int] = None,
) -> dict[int, float]:
    """One logprobs entry: the chosen token first (as vLLM 0.2 builds it), then
    the first ``num`` of the top tokens (all given if ``num`` is None), which the
    sampler returns sorted best first. Plain Python numbers, ready to print."""
    entry = {int(token_id): float(logprob)}
    n = len(top_token_ids) if num is None else min(num, len(top_token_ids))
    for tid, lp in zip(list(top_token_ids)[:n], list(top_logprobs)[:n]):
        entry.setdefault(int(tid), float(lp))
    return entry


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    ``finish_reason`` is None while running, then "stop" (EOS, stop token or
    stop string) or "length" (max_tokens or the context limit). ``stop_reason``
    is the stop string or stop token id that ended it, None for EOS / length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob:.4f}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """Everything about one request so far: its prompt and its ``n`` outputs."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    finish_message: Optional[str] = None  # why the engine ended it early (rejected prompt, aborted)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished})"
        )


def request_output(group: "SequenceGroup", prompt_logprobs: Optional[PromptLogprobs]) -> RequestOutput:
    """What a request has to show so far: its ``n`` best sequences (beam hypotheses by
    length-penalised score, ``best_of`` samples by cumulative logprob once finished)."""
    p = group.sampling_params
    seqs = group.get_seqs()
    finished = group.is_finished()
    if group.beam is not None:
        # Finished: the best hypotheses by length-penalised score; meanwhile (or when the request
        # ended early, before any hypothesis) the best beams by cumulative logprob.
        hyps = [s for s in seqs if s.beam_score is not None]
        if finished and hyps:
            seqs = sorted(hyps, key=lambda s: -s.beam_score)[: p.n]
        else:
            seqs = sorted([s for s in seqs if s.beam_score is None],
                          key=lambda s: -s.cumulative_logprob)[: p.n]
    elif len(seqs) > 1 and finished:
        # best_of > n: the n samples with the highest cumulative logprob.
        seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
    elif len(seqs) > 1:
        seqs = seqs[: p.n]
    outs = [CompletionOutput(i, s.output_text, list(s.output_token_ids), s.cumulative_logprob,
                             list(s.output_logprobs) if p.logprobs is not None else None,
                             s.status.finish_reason, s.stop_reason) for i, s in enumerate(seqs)]
    return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids),
                         prompt_logprobs, outs, finished, group.finish_message)
