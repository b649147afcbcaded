"""The n-gram proposer against a brute-force statement of vLLM's rule, and vLLM's own examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.spec_decode.ngram import NgramProposer, propose_ngram


def oracle(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len=None) -> list[int]:
    """Longest suffix of length in [min_n, max_n] occurring earlier (ending before the last token);
    its first occurrence; the up to k tokens after it (k capped by max_model_len)."""
    if max_model_len is not None:
        k = min(k, max_model_len - len(tokens))
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:] if n <= len(tokens) else None
        for start in range(len(tokens) - n):  # start + n <= len - 1: a token follows the occurrence
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), min_n=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(1, 6), max_model_len=st.one_of(st.none(), st.integers(1, 45)))
def test_proposals_match_the_brute_force_rule(tokens, min_n, extra, k, max_model_len):
    max_n = min_n + extra
    assert propose_ngram(tokens, min_n, max_n, k, max_model_len) == oracle(tokens, min_n, max_n, k, max_model_len)


@pytest.mark.parametrize("tokens,min_n,max_n,k,expected", [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),                     # the suffix [5, 6] never occurred
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),                 # the first occurrence of [3]
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),                       # fewer than k tokens follow
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),       # the 4-gram wins over the 3-gram
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
])
def test_vllm_examples(tokens, min_n, max_n, k, expected):
    assert propose_ngram(tokens, min_n, max_n, k) == expected


def test_proposer_caps_k_by_the_tokens_left():
    p = NgramProposer(4, 1, 2, max_model_len=9)
    tokens = [1, 2, 3, 4, 1, 2]
    assert p.propose(tokens) == [3, 4, 1]  # max_model_len leaves room for 3
    assert p.propose(tokens, max_tokens=2) == [3, 4]
    assert p.propose(tokens, max_tokens=0) == []
