"""Sampled drafts: a draft model serving a sampled request draws each proposal from ``q``, its own
distribution after the request's processing (penalties, temperature, top-k, top-p, min-p: the
sampler's, :func:`paged_jax.sampler.processed_probs`), and keeps ``q``; the target's step returns
``p``, its distribution at the same positions processed the same way, and the general rejection
sampler (:mod:`.rejection`) accepts or resamples, so the emitted tokens follow the target's
distribution exactly (Leviathan et al. 2023, Chen et al. 2023).

Randomness. A seeded request's draws come from numpy generators keyed by its per-sample seed, the
number of output tokens before the position and the use (drawing a draft, verifying a row): the same
seed gives the same tokens whatever the batch, preemption or the other requests. Unseeded requests
draw from the engine's generator (seeded with the engine's seed). The tokens differ from plain
decoding's for the same seed (another procedure draws them); their distribution is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from paged_jax.executor.interface import Sample
from paged_jax.outputs import make_logprobs_dict
from paged_jax.sampling_params import SamplingType
from paged_jax.seeds import seed_for_sample

if TYPE_CHECKING:
    from paged_jax.scheduler import ScheduledSeq

DRAFT, VERIFY = 0, 1  # the uses a seeded row's generators are keyed by


@dataclass
class SampledDrafts:
    """One row's sampled drafts: ``q`` float32[n, V], the distribution draft j was drawn from; the
    row's seed (None: unseeded) and the top-N logprobs its request asks for."""

    q: np.ndarray
    seed: Optional[int]
    logprobs: Optional[int]


def is_sampled(row: "ScheduledSeq") -> bool:
    """Whether a row's request samples (its drafts are then drawn, not argmax)."""
    return row.group.sampling_params.sampling_type is not SamplingType.GREEDY


def row_seed(row: "ScheduledSeq") -> Optional[int]:
    """The seed of a decoding row's one sample (the engine's, ``paged_jax.row_sampling.row_sampling``)."""
    p = row.group.sampling_params
    return None if p.seed is None else seed_for_sample(p.seed, row.seq.sample_index)


def position_rng(seed: Optional[int], offset: int, use: int, unseeded: np.random.Generator) -> np.random.Generator:
    """The generator of a seeded row's draws at the position after ``offset`` output tokens, for
    ``use``; ``unseeded`` for a row without a seed."""
    return unseeded if seed is None else np.random.default_rng([seed % (1 << 64), offset, use])


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from ``probs`` (float[V]) by inverse CDF; never one of probability zero."""
    cdf = np.cumsum(probs, dtype=np.float64)
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(token, int(np.flatnonzero(probs > 0)[-1]))


def verify(drafts: list[int], sampled: SampledDrafts, samples: list[Sample], k: int, offset: int,
           unseeded: np.random.Generator) -> list[Sample]:
    """The samples a row emits: its accepted drafts and the token after them (resampled from
    ``norm(max(0, p - q))`` at the first rejection, else drawn from ``p`` after the last draft).
    ``samples``: the target's, one per position, each carrying ``p`` (``Sample.probs``); ``k``: the
    most drafts a row gets (one compiled shape for every row); ``offset``: the output tokens before
    the first draft."""
    from paged_jax.spec_decode.rejection import rejection_sample  # jitted: JAX only once a sampled draft is verified

    n = len(drafts)
    p = np.stack([s.probs for s in samples]).astype(np.float32)
    V = p.shape[1]
    target, draft = np.zeros((1, k + 1, V), np.float32), np.zeros((1, k, V), np.float32)
    target[0, :n + 1], draft[0, :n] = p, sampled.q
    tokens = np.zeros((1, k), np.int32)
    tokens[0, :n] = drafts
    u = position_rng(sampled.seed, offset, VERIFY, unseeded).random(k + 1, np.float32)
    accepted, last = rejection_sample(target, draft, tokens, np.array([n], np.int32), u[None, :k], u[k:])
    emitted = list(drafts[:int(accepted[0])]) + [int(last[0])]
    return [_sample(t, p[j], sampled.logprobs) for j, t in enumerate(emitted)]


def _sample(token: int, probs: np.ndarray, num_top: Optional[int]) -> Sample:
    """A verified token's sample: its logprob under the target's processed distribution (what plain
    sampling reports), and the top-``num_top`` entry when asked."""
    with np.errstate(divide="ignore"):
        logprobs = np.log(probs)
    entry = None
    if num_top is not None:
        top = np.argsort(-logprobs, kind="stable")[:num_top]
        entry = make_logprobs_dict(token, logprobs[token], top, logprobs[top], num_top)
    return Sample(int(token), float(logprobs[token]), entry)
