"""The n-gram (prompt lookup) proposer: draft tokens looked up in the request's own tokens.

vLLM's semantics (``NgramProposer``): among the suffixes of the tokens (prompt + output) whose
length ``n`` is in ``[prompt_lookup_min, prompt_lookup_max]``, take the longest that also occurs
earlier, ending before the last token; of its earlier occurrences take the *first* (vLLM picks
the earliest one); propose the up to ``k`` tokens that follow it (fewer when the tokens end
sooner). ``k`` is first capped so that the tokens and the proposals fit ``max_model_len``.

Plain numpy, no JAX: it runs above the executor border, once per decoding sequence and step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int,
                  max_model_len: int | None = None) -> list[int]:
    """The draft tokens for ``token_ids`` (see the module docstring); [] when none matches.

    The search keeps the end positions ``e`` (before the last token) where the suffix of length
    ``j + 1`` ends; each round extends the surviving ones one token further back. A suffix longer
    than ``min_n`` only replaces a shorter match: the longest one wins, its earliest occurrence
    gives the proposal."""
    n_tokens = len(token_ids)
    if max_model_len is not None:
        k = min(k, max_model_len - n_tokens)
    if k <= 0 or n_tokens < max(min_n, 2):
        return []
    tokens = np.asarray(token_ids)
    # Ends e of occurrences of the last token, e <= n_tokens - 2 (a token must follow each occurrence).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_len, best_end = 0, -1
    for length in range(1, max_n + 1):
        if not ends.size:
            break
        if length >= min_n:
            best_len, best_end = length, int(ends[0])
        if length == max_n:
            break
        # Extend each surviving occurrence one token back: it needs a token before its start.
        ends = ends[ends >= length]
        ends = ends[tokens[ends - length] == tokens[n_tokens - 1 - length]]
    if best_len == 0:
        return []
    start = best_end + 1
    return tokens[start:start + k].tolist()


class NgramProposer:
    """Proposals for sequences, with the engine's settings (see :class:`SpeculativeConfig`)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int | None = None) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens continuing ``token_ids``."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        return propose_ngram(token_ids, self.min_n, self.max_n, k, self.max_model_len)
