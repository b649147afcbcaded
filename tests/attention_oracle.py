"""The paged attention oracle the kernel and backend tests share: float64 loops over each query,
gathering its sequence's keys through the block table (causal; optionally a window, a soft-cap and a
sink logit per head)."""

from __future__ import annotations

import numpy as np


def numpy_attention(q, k, v, tables, lens, qlens, scale, window=None, cap=None, sinks=None):
    """q [S, Q, H, D]; k, v float [blocks, block_size, KVH, D]. Query i of sequence s at position
    lens[s] - qlens[s] + i sees positions <= its own (and > its own - window); ``sinks``: a logit a
    query head, one more term exp(sink) in each softmax's denominator; float64 loops."""
    q, k, v, tables = (np.asarray(a) for a in (q, k, v, tables))
    S, _, H, D = q.shape
    bs, KVH = k.shape[1], k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for s in range(S):
        L, n = int(lens[s]), int(qlens[s]) if lens[s] else 0  # a padded row (length 0): zeros
        t = np.arange(L)
        keys = k[tables[s, t // bs], t % bs].astype(np.float64)  # [L, KVH, D], gathered once a row
        vals = v[tables[s, t // bs], t % bs].astype(np.float64)
        for i in range(n):
            pos = L - n + i
            seen = t <= pos
            if window is not None:
                seen &= t > pos - window
            for h in range(H):
                kvh = h // (H // KVH)
                x = keys[:, kvh] @ q[s, i, h].astype(np.float64) * scale
                if cap is not None:
                    x = cap * np.tanh(x / cap)
                x = np.where(seen, x, -np.inf)
                m = x.max() if sinks is None else max(x.max(), float(sinks[h]))
                p = np.exp(x - m)
                den = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                out[s, i, h] = (p / den) @ vals[:, kvh]
    return out
