"""Prefill attention in plain jnp, blockwise: memory linear in the prompt's length.

The same function as :func:`paged_attention_reference` (the readable definition, and the
oracle this is tested against), computed flash-attention style so that no ``[query,
context]`` score matrix is ever built for the whole prompt. The queries are taken
``q_chunk`` at a time (``lax.map``); for each query tile a ``lax.fori_loop`` walks the
sequence's block table ``kv_chunk`` tokens (whole pages) at a time, gathers those pages of
K and V from the paged cache, and folds them into an online softmax in float32 (running
max ``m``, running sum ``l``, accumulator ``o``). The live scores are one
``[S, KVH, G, q_chunk, kv_chunk]`` tile, whatever the prompt's length; what grows with
it is the output and the cache, both linear.

The walk for a query tile stops at the last key its queries may see (causal bound, the
largest over the batch's rows), so a prompt does about half the work of the dense
reference; with a ``sliding_window`` it also starts at the first chunk the tile's earliest
query may see. Keys are masked exactly as in the reference (causal, each sequence's
length, the window, and a ``mask_mod``), and a ``score_mod`` sees each tile's float32
scores with ``q_pos`` ``[S, 1, 1, q_chunk, 1]`` and ``k_pos`` ``[1, 1, 1, 1, kv_chunk]``:
the reference's hooks work unchanged as long as they are elementwise in (score,
position), as the documented ones are.

This is the ``"reference"`` backend's prefill, and so the ``"native"`` backend's (the
engine's ``"auto"`` choice on a CPU): ``experiments/bench_long_prompt.py`` measures it
against the dense reference on prompts up to 32k tokens.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from paged_jax.attention import kv_quant
from paged_jax.attention.reference import MaskMod, ScoreMod

_NEG = -1e30  # masked score (finite: a row that sees nothing stays NaN-free)
ROWS_PER_GROUP = 32  # at most: one long row in a group makes the whole group read that far


def blockwise_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *,
                            score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
                            sliding_window: Optional[int] = None, q_chunk: int = 256, kv_chunk: int = 512,
                            sinks=None):
    """Causal attention of each sequence's new queries over its paged K/V, blockwise.

    Arguments and result as :func:`paged_attention_reference` (q ``[S, Q, H, D]``, query ``i``
    of sequence ``s`` at position ``context_lens[s] - query_lens[s] + i``; caches
    ``[num_blocks, block_size, KVH, D]``; returns ``[S, Q, H, D]`` in q's dtype, softmax in
    float32; rows ``i >= query_lens[s]`` are padding, unspecified). ``sliding_window``: a query
    at position ``p`` sees only ``p - window + 1 .. p`` (and chunks wholly before the window are
    skipped; pass it here rather than as a ``mask_mod`` to get the skip). ``q_chunk``: queries
    per tile; ``kv_chunk``: K/V tokens per loop step (rounded down to whole pages, at least one).
    Rows shorter than ``q_chunk`` (query tiles) go in groups of about ``q_chunk`` queries.
    ``sinks``: float32 ``[H]`` sink logits, which start each row's online softmax (running max the
    sink, running sum ``exp(0) = 1``, no value): the reference's extra key, at no cost per chunk.
    """
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    block_tables = jnp.asarray(block_tables, jnp.int32)
    context_lens = jnp.asarray(context_lens, jnp.int32)
    query_lens = jnp.asarray(query_lens, jnp.int32)
    S, Q = q.shape[:2]
    g = max(1, min(S, q_chunk // max(Q, 1), ROWS_PER_GROUP))  # rows per group: about q_chunk queries
    if g >= S:
        return _blockwise(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, score_mod, mask_mod,
                          sliding_window, q_chunk, kv_chunk, sinks)
    # Many rows (the query tiles of a ragged step): a group of rows at a time, each group's K/V
    # walk stopping at its own causal bound (consecutive tiles of one sequence have about the
    # same; a group of padded tiles walks none), rather than every row walking to the longest.
    n = -(-S // g)

    def rows(x):
        x = jnp.pad(x, [(0, n * g - S)] + [(0, 0)] * (x.ndim - 1))  # padded rows: no queries, no keys
        return x.reshape(n, g, *x.shape[1:])

    out = lax.map(lambda a: _blockwise(a[0], k_cache, v_cache, a[1], a[2], a[3], scale, score_mod, mask_mod,
                                       sliding_window, q_chunk, kv_chunk, sinks),
                  (rows(q), rows(block_tables), rows(context_lens), rows(query_lens)))
    return out.reshape(n * g, *out.shape[2:])[:S]


def _blockwise(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, score_mod, mask_mod,
               sliding_window, q_chunk, kv_chunk, sinks=None):
    S, Q, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    G = H // KVH
    qc = max(1, min(Q, q_chunk))
    nq = -(-Q // qc)
    # Pages per K/V chunk: no more than the tables hold (a chunk past them would only gather null blocks).
    ppc = max(1, min(kv_chunk // block_size, block_tables.shape[1]))
    lc = ppc * block_size
    B = block_tables.shape[1]
    nkv = -(-B // ppc)
    # Pad the tables with the null block so every chunk's page ids are in bounds (those slots are masked).
    tables = jnp.pad(block_tables, ((0, 0), (0, nkv * ppc - B)))
    start = context_lens - query_lens  # position of each sequence's first new query
    scale = jnp.asarray(scale, jnp.float32)

    # [S, Q, H, D] -> [nq, S, KVH, G, qc, D]: query tiles, head-major (the layout XLA's CPU backend runs best).
    qt = jnp.pad(q, ((0, 0), (0, nq * qc - Q), (0, 0), (0, 0)))
    qt = qt.reshape(S, nq, qc, KVH, G, D).transpose(1, 0, 3, 4, 2, 5)

    def query_tile(args):
        i, qi = args  # qi [S, KVH, G, qc, D]
        first = i * qc
        q_pos = start[:, None] + first + jnp.arange(qc, dtype=jnp.int32)[None, :]  # [S, qc]
        q_pos5 = q_pos[:, None, None, :, None]
        real = first < query_lens  # rows with a real query in this tile
        # Keys up to the tile's last real query (causal bound), over the batch's rows.
        n_keys = jnp.max(jnp.where(real, jnp.minimum(start + first + qc, context_lens), 0))
        hi = (n_keys + lc - 1) // lc
        lo = jnp.int32(0)
        if sliding_window is not None:
            earliest = jnp.min(jnp.where(real, start + first - sliding_window + 1, jnp.iinfo(jnp.int32).max))
            lo = jnp.minimum(jnp.maximum(earliest, 0) // lc, hi)

        def kv_step(c, carry):
            o, m, l = carry  # o [S, KVH, G, qc, D], m and l [S, KVH, G, qc]
            pages = lax.dynamic_slice_in_dim(tables, c * ppc, ppc, axis=1)  # [S, ppc]
            # [S, KVH, lc, D]; an 8-bit cache is dequantized as gathered (kv_quant)
            k = kv_quant.dequantize(k_cache[pages], D, qi.dtype).reshape(S, lc, KVH, D).transpose(0, 2, 1, 3)
            v = kv_quant.dequantize(v_cache[pages], D, qi.dtype).reshape(S, lc, KVH, D).transpose(0, 2, 1, 3)
            k_pos = c * lc + jnp.arange(lc, dtype=jnp.int32)
            k_pos5 = k_pos[None, None, None, None, :]
            s = jnp.einsum("skgqd,skld->skgql", qi, k, preferred_element_type=jnp.float32) * scale
            if score_mod is not None:
                s = score_mod(s, q_pos5, k_pos5)
            in_seq = k_pos[None, :] < context_lens[:, None]  # [S, lc]
            mask = (k_pos5 <= q_pos5) & in_seq[:, None, None, None, :]
            if sliding_window is not None:
                mask = mask & (k_pos5 > q_pos5 - sliding_window)
            if mask_mod is not None:
                mask = mask & mask_mod(q_pos5, k_pos5)
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            # A stale Inf/NaN in a slot past the context must not reach p @ v (0 * NaN is NaN).
            v = jnp.where(in_seq[:, None, :, None], v, 0)
            pv = jnp.einsum("skgql,skld->skgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return o * alpha[..., None] + pv, m_new, l * alpha + p.sum(-1)

        m0, l0 = jnp.full((S, KVH, G, qc), _NEG, jnp.float32), jnp.zeros((S, KVH, G, qc), jnp.float32)
        if sinks is not None:  # the sink is the first "key": max = sink, sum = exp(sink - sink), no value
            m0 = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(1, KVH, G, 1), m0.shape)
            l0 = jnp.ones_like(l0)
        init = (jnp.zeros((S, KVH, G, qc, D), jnp.float32), m0, l0)
        o, _, l = lax.fori_loop(lo, hi, kv_step, init)
        return (o / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)

    out = lax.map(query_tile, (jnp.arange(nq, dtype=jnp.int32), qt))  # [nq, S, KVH, G, qc, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(S, nq * qc, H, D)
    return out[:, :Q]
