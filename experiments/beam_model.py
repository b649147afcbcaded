"""Beam search in the simulator: real beam selection over synthetic next-token scores.

The engine runs a request of beam width ``k`` as ``k`` sequences forked from the
prompt (``SamplingParams(n=k, best_of=k)``: they share the prompt's blocks).
After every iteration in which all of a request's beams got a token, this model
does what beam search does with the block tables: each beam ``b`` (score ``s_b``)
proposes its ``k`` best next tokens with log-probabilities ``l_b1 > l_b2 > ...``;
the ``k`` best candidates ``s_b + l_bj`` overall become the new beams. A beam no
candidate descends from is freed; a beam two or more descend from is forked
(the children share all its blocks; copy-on-write separates their last block).

The scores are the one modelling choice: the gaps between a beam's successive
candidates, ``l_b1 = -g_1`` and ``l_bj = l_b(j-1) - g_j``, are exponential with
mean ``gap`` nats (default 1: a next-token distribution whose second choice is
on average e times less likely than the first). Smaller gaps keep beams apart
longer; larger gaps make the best beam take over (more sharing).
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from paged_jax.sequence import SequenceStatus

FIRST_FORK_ID = 10 ** 12  # sequence ids for forks made here (the engine counts from 0)


class BeamModel:
    def __init__(self, gap: float = 1.0, seed: int = 0):
        if not gap > 0:
            raise ValueError(f"gap must be > 0 nats, got {gap!r}")
        self.gap = gap
        self.rng = np.random.default_rng(seed)
        self.widths: dict[str, int] = {}  # engine request id -> beam width
        self.scores: dict[int, float] = {}  # seq id -> cumulative log-probability
        self._ids = itertools.count(FIRST_FORK_ID)
        self.num_forks = self.num_freed = 0

    def add(self, request_id: str, width: int) -> None:
        self.widths[request_id] = width

    def after_step(self, engine) -> None:
        bm = engine.block_manager
        for group in engine.scheduler.running:
            k = self.widths.get(group.request_id)
            if not k:
                continue
            beams = group.get_seqs(SequenceStatus.RUNNING)
            # Only right after every beam got its token (not mid-prefill, not before the fork).
            if len(beams) != k or any(b.num_computed_tokens != b.get_len() - 1 for b in beams):
                continue
            base = np.array([self.scores.get(b.seq_id, 0.0) for b in beams])
            cand = base[:, None] - np.cumsum(self.rng.exponential(self.gap, (k, k)), axis=1)
            top = np.argsort(cand, axis=None)[-k:]
            children = Counter(int(t) // k for t in top)
            new_scores = sorted(((int(t) // k, float(cand.flat[t])) for t in top), key=lambda x: x[0])
            for b, beam in enumerate(beams):
                if not children[b]:
                    engine.scheduler.free_seq(beam)
                    group.remove(beam.seq_id)
                    self.scores.pop(beam.seq_id, None)
                    self.num_freed += 1
            it = iter(new_scores)
            for b, beam in enumerate(beams):
                for c in range(children[b]):
                    _, score = next(it)
                    if c == 0:
                        self.scores[beam.seq_id] = score
                        continue
                    child = beam.fork(next(self._ids), sample_index=beam.sample_index)
                    bm.fork(beam, child)
                    group.add(child)
                    self.scores[child.seq_id] = score
                    self.num_forks += 1
