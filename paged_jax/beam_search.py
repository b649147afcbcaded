"""Beam search, step by step, with Hugging Face ``generate(num_beams=k)``'s semantics.

One step takes the running beams (their cumulative logprobs) and each beam's
best next-token candidates, and decides which beams live on (and from which
parent), which candidates become finished hypotheses, and whether the search
is over. The engine applies the decision through the block manager: a parent
chosen twice is forked (its blocks shared, the last one copied on write), a
parent chosen by nobody is freed, so beams share the blocks of their common
history.

The rules are those of transformers' ``_beam_search``:

- the ``K = max(2, 1 + number of stop tokens) * width`` best continuations of
  all beams (by cumulative logprob) are the candidates, so that ``width`` of
  them can always go on even if many end;
- a candidate that ends (EOS, a stop token, or the length limit) becomes a
  finished hypothesis only if it ranks among the first ``width`` candidates;
  its score is ``cumulative logprob / generated_length ** length_penalty``,
  and the best ``width`` hypotheses are kept;
- the ``width`` best candidates that do not end are the next beams;
- the search stops when every candidate ends (length limit), when
  ``early_stopping=True`` and ``width`` hypotheses are finished, or when no
  running beam can still beat the worst finished hypothesis (with
  ``early_stopping=False`` judged at the current length, with ``"never"`` and
  a positive length penalty at the maximum length).

Scores are float32 sums, as in transformers. Plain Python and numpy: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np

_f32 = np.float32


def num_candidates(width: int, num_stop_tokens: int) -> int:
    """How many continuations a step keeps (and each beam must offer)."""
    return max(2, 1 + num_stop_tokens) * width


@dataclass
class BeamState:
    """Per-request search state, kept on the sequence group."""

    width: int
    length_penalty: float
    early_stopping: Union[bool, str]
    max_new_tokens: int          # the length limit, in generated tokens
    num_candidates: int
    improvable: bool = True      # can a running beam still beat the finished hypotheses?
    done: bool = False


@dataclass
class Candidate:
    score: np.float32            # cumulative logprob with this token
    parent: int                  # index of the beam it extends
    token_id: int
    logprob: float
    ends: bool = False


@dataclass
class StepDecision:
    running: list[Candidate] = field(default_factory=list)    # the next beams, best first
    finished: list[tuple[Candidate, np.float32]] = field(default_factory=list)  # new hypotheses, with scores
    done: bool = False


def normalized_score(score, generated_len: int, length_penalty: float) -> np.float32:
    """``score / generated_len ** length_penalty`` in float32, as transformers ranks hypotheses.

    The power is taken in numpy float64, which saturates to inf (or 0) where Python's ``**``
    would raise OverflowError for a large penalty or length; the float32 ratio then saturates
    to 0 or -inf, so such a search still ranks its hypotheses and never raises."""
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        return _f32(_f32(score) / _f32(np.float64(generated_len) ** length_penalty))


def beam_step(state: BeamState, beam_scores: list[float], candidates: list[tuple[list[int], list[float]]],
              generated_len: int, finished_scores: list[float], ends: Callable[[int], bool]) -> StepDecision:
    """One step of the search.

    beam_scores: each running beam's cumulative logprob. candidates: per beam,
    its best token ids and their logprobs (best first, at least
    ``state.num_candidates`` of them unless the vocabulary is smaller).
    generated_len: tokens each beam has generated so far (all beams advance
    together). finished_scores: the kept hypotheses' scores. ends(token_id):
    whether that token ends a hypothesis (EOS or a stop token).
    Updates ``state.improvable`` and ``state.done``.
    """
    pool = []
    for b, (ids, lps) in enumerate(candidates):
        base = _f32(beam_scores[b])
        for tok, lp in zip(ids, lps):
            pool.append(Candidate(_f32(base + _f32(lp)), b, int(tok), float(lp)))
    # Stable sort: ties keep (beam, rank) order, as a top-k over the flattened [beam, vocab] scores does.
    pool.sort(key=lambda c: -float(c.score))
    pool = pool[: state.num_candidates]
    new_len = generated_len + 1
    at_limit = new_len >= state.max_new_tokens
    for c in pool:
        c.ends = at_limit or ends(c.token_id)

    decision = StepDecision()
    decision.running = [c for c in pool if not c.ends][: state.width]

    full = len(finished_scores) >= state.width
    if state.improvable and not (full and state.early_stopping is True):
        for c in pool[: state.width]:
            if c.ends:
                decision.finished.append((c, normalized_score(c.score, new_len, state.length_penalty)))
    kept = sorted([*finished_scores, *(s for _, s in decision.finished)], key=lambda s: -float(s))[: state.width]

    # Can the best running beam still beat the worst kept hypothesis?
    if decision.running and len(kept) >= state.width:
        if state.early_stopping == "never" and state.length_penalty > 0:
            best_len = state.max_new_tokens
        else:
            best_len = new_len
        best = normalized_score(decision.running[0].score, best_len, state.length_penalty)
        if not best > kept[-1]:
            state.improvable = False
    state.done = (not state.improvable or (len(kept) >= state.width and state.early_stopping is True)
                  or not decision.running)
    decision.done = state.done
    return decision
