"""The general rejection sampler (drafts drawn from a draft distribution q): the tokens it emits follow
the target's distribution p at every position (a chi-square test on a small vocabulary against p
itself), and each draft is accepted with probability sum_x min(p(x), q(x))."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from paged_jax.spec_decode.rejection import rejection_sample

V, K, N = 6, 3, 40_000


def distributions(rng, n, zeros):
    """``n`` distributions over V tokens, each with ``zeros`` tokens of probability zero."""
    d = rng.dirichlet(np.ones(V), size=n)
    for row in d:
        row[rng.choice(V, zeros, replace=False)] = 0.0
    return d / d.sum(-1, keepdims=True)


def emitted(p, q, num_drafts, seed):
    """Run N rows sharing p [K + 1, V] and q [K, V]; drafts drawn from q with numpy."""
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(V, N, p=q[j]) for j in range(K)], axis=1).astype(np.int32)
    n, nxt = rejection_sample(np.broadcast_to(p, (N, K + 1, V)).astype(np.float32),
                              np.broadcast_to(q, (N, K, V)).astype(np.float32), drafts,
                              num_drafts.astype(np.int32), rng.random((N, K), np.float32),
                              rng.random(N, np.float32))
    n, nxt = np.asarray(n), np.asarray(nxt)
    tokens = [list(drafts[r, :n[r]]) + [int(nxt[r])] for r in range(N)]
    return n, tokens


@pytest.mark.parametrize("zeros", [0, 2])
def test_emitted_tokens_follow_the_target_at_every_position(zeros):
    rng = np.random.default_rng(zeros)
    p, q = distributions(rng, K + 1, zeros), distributions(rng, K, zeros)
    num_drafts = rng.integers(0, K + 1, N)
    n, tokens = emitted(p, q, num_drafts, seed=10 + zeros)
    assert (n <= num_drafts).all()
    for m in range(K + 1):
        at_m = np.array([t[m] for t in tokens if len(t) > m])
        counts = np.bincount(at_m, minlength=V)
        support = p[m] > 0
        assert counts[~support].sum() == 0, f"position {m}: a token of target probability zero was emitted"
        expected = p[m][support] * len(at_m)
        assert stats.chisquare(counts[support], expected).pvalue > 1e-3, (m, counts, expected.round())


def test_each_draft_is_accepted_with_probability_sum_of_min_p_q():
    rng = np.random.default_rng(5)
    p, q = distributions(rng, K + 1, 1), distributions(rng, K, 1)
    n, _ = emitted(p, q, np.full(N, K), seed=6)
    reached = N
    for j in range(K):
        accepted = int((n > j).sum())
        rate = np.minimum(p[j], q[j]).sum()
        sd = np.sqrt(reached * rate * (1 - rate))
        assert abs(accepted - reached * rate) < 4 * sd, (j, accepted / reached, rate)
        reached = accepted


def test_a_draft_q_puts_all_its_mass_on_is_accepted_with_probability_p():
    """The n-gram case: q one-hot on the draft."""
    rng = np.random.default_rng(7)
    p = distributions(rng, K + 1, 0)
    q = np.zeros((K, V))
    q[np.arange(K), [1, 3, 0]] = 1.0
    n, tokens = emitted(p, q, np.full(N, K), seed=8)
    assert abs((n > 0).mean() - p[0, 1]) < 4 * np.sqrt(p[0, 1] * (1 - p[0, 1]) / N)
    first = np.bincount([t[0] for t in tokens], minlength=V)
    assert stats.chisquare(first, p[0] * N).pvalue > 1e-3
