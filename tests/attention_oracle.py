"""The paged attention oracle the kernel and backend tests share: float64 loops over each query,
gathering its sequence's keys through the block table (causal; optionally a window, a soft-cap and a
sink logit per head)."""

from __future__ import annotations

import numpy as np


def numpy_attention(q, k, v, tables, lens, qlens, scale, window=None, cap=None, sinks=None):
    """q [S, Q, H, D]; k, v float [blocks, block_size, KVH, D]. Query i of sequence s at position
    lens[s] - qlens[s] + i sees positions <= its own (and > its own - window); ``sinks``: a logit a
    query head, one more term exp(sink) in each softmax's denominator; float64 loops."""
    S, _, H, D = q.shape
    bs, KVH = k.shape[1], k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for s in range(S):
        L, n = int(lens[s]), int(qlens[s]) if lens[s] else 0  # a padded row (length 0): zeros
        rows = [(tables[s, t // bs], t % bs) for t in range(L)]
        for i in range(n):
            pos = L - n + i
            seen = np.arange(L) <= pos
            if window is not None:
                seen &= np.arange(L) > pos - window
            for h in range(H):
                kvh = h // (H // KVH)
                kk = np.stack([k[b, o, kvh] for b, o in rows])
                vv = np.stack([v[b, o, kvh] for b, o in rows])
                x = kk @ q[s, i, h].astype(np.float64) * scale
                if cap is not None:
                    x = cap * np.tanh(x / cap)
                x = np.where(seen, x, -np.inf)
                m = x.max() if sinks is None else max(x.max(), float(sinks[h]))
                p = np.exp(x - m)
                den = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                out[s, i, h] = (p / den) @ vv
    return out
