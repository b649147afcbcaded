"""Synthetic workloads: published means, the length cap, Poisson arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.workloads import (CHAT_HISTORY_LIMIT, DATASETS, MAX_TOTAL_LEN, make_chat_trace,
                                   make_prefix_trace, make_trace, poisson_arrivals, sample_lengths)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_lengths_match_the_published_means_and_cap(name):
    ins, outs = sample_lengths(name, 100_000, seed=11)  # an independent draw from the calibration's
    d = DATASETS[name]
    assert ins.mean() == pytest.approx(d.mean_input, rel=0.02)
    assert outs.mean() == pytest.approx(d.mean_output, rel=0.02)
    assert (ins + outs).max() < MAX_TOTAL_LEN and ins.min() >= 1 and outs.min() >= 1


def test_sharegpt_is_longer_and_more_varied_than_alpaca():
    s_in, s_out = sample_lengths("sharegpt", 20_000)
    a_in, a_out = sample_lengths("alpaca", 20_000)
    assert 7 < s_in.mean() / a_in.mean() < 10 and 5 < s_out.mean() / a_out.mean() < 7  # paper: 8.4x, 5.8x
    assert s_in.std() / s_in.mean() > a_in.std() / a_in.mean()


def test_poisson_arrivals():
    t = poisson_arrivals(4.0, 20_000, seed=3)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03) and gaps.std() == pytest.approx(0.25, rel=0.05)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0, 10)


def test_traces():
    tr = make_trace("alpaca", 10.0, 50, n=4)
    assert len(tr) == 50 and all(r.n == 4 for r in tr)
    assert all(a.arrival <= b.arrival for a, b in zip(tr, tr[1:]))
    pre = make_prefix_trace("5-shot", 1.0, 20)
    assert all(r.prefix_len == 341 and r.prompt_len > 341 for r in pre)
    chat = make_chat_trace(1.0, 300)
    assert max(r.prompt_len for r in chat) == CHAT_HISTORY_LIMIT and max(r.output_len for r in chat) <= 1024
    with pytest.raises(ValueError, match="unknown dataset"):
        make_trace("wiki", 1.0, 5)
    with pytest.raises(ValueError, match="num_requests"):
        make_trace("alpaca", 1.0, 0)
