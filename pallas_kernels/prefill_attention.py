"""Paged attention PREFILL kernel in Pallas (Triton backend): several causal queries per
sequence over a cached prefix read through the block table (chunked prefill, prefix caching).
Checked against :func:`paged_jax.attention.reference.paged_attention_reference`.

Query ``i`` of sequence ``s`` (``context_lens[s] = C``, ``query_lens[s] = Q``) sits at
position ``C - Q + i`` and attends to every cached position ``<=`` that; its own K/V and
those of the earlier queries of the step are already in the pool (the layer writes first).

Grid ``(S, num_kv_heads, num_query_tiles)``. A program takes ``BQ`` consecutive queries of
sequence ``s`` times the ``G`` query heads that share KV head ``h`` (padded to ``Gp``, a
power of two), laid out as ``R = BQ * Gp`` rows ``r = query * Gp + head``, so each K/V tile
is loaded once for the group (GQA/MQA) and both products are ``[R, *]`` matmuls with
``R >= 16`` (Triton's ``tl.dot`` minimum). It walks its sequence's block table
``pages_per_chunk`` pages at a time, only up to the last position its queries may see
(the causal bound), gathers those pages of K and V with ``k_ref[page_ids]``, masks
``k_pos > q_pos`` and ``k_pos >= C`` and updates an online softmax in float32. Tiles past
``Q`` run no loop at all, and padded batch rows (``C = Q = 0``) give zeros. With a
``sliding_window`` the walk starts at the first chunk a tile's first query may see, and
``logit_soft_cap`` caps the scores (both shared with the decode kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import (_MIN_DOT, _NEG, _next_pow2, attend_chunk, check_shapes, first_chunk,
                                            matmul_precision, triton_params, visible_keys)


def _prefill_kernel(scale_ref, len_ref, qlen_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *,
                    block_size: int, pages_per_chunk: int, queries_per_tile: int, heads_per_row: int, precision,
                    sliding_window: int | None, logit_soft_cap: float | None):
    """One (sequence, kv head, query tile).

    scale_ref [1] f32; len_ref, qlen_ref [1] i32; bt_ref [max_blocks_padded] i32;
    q_ref [R, D] (rows query-major, Gp heads each); k_ref/v_ref [num_blocks, block_size, D]
    (this kv head's view); o_ref [R, D].
    """
    tile = pl.program_id(2)
    rows, d = q_ref.shape
    chunk = pages_per_chunk * block_size
    length = len_ref[0]
    qlen = qlen_ref[0]
    first_q = tile * queries_per_tile
    # Position of each row's query; the tile's last real query bounds the keys it reads.
    q_pos = length - qlen + first_q + jnp.arange(rows, dtype=jnp.int32) // heads_per_row
    last_q = jnp.minimum(first_q + queries_per_tile, qlen)  # queries [first_q, last_q) are real
    n_keys = jnp.where(first_q < qlen, length - qlen + last_q, 0)
    n_chunks = pl.cdiv(n_keys, chunk)
    q = q_ref[...]
    scale = scale_ref[0]
    # With a window, the tile's first query bounds the keys from below.
    lo = 0 if sliding_window is None else first_chunk(length - qlen + first_q - sliding_window + 1, chunk)

    def body(c, carry):
        pages = bt_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = visible_keys(q_pos, k_pos, length, sliding_window)
        return attend_chunk(carry, q, k_ref, v_ref, pages, k_pos, visible, length, scale, precision, logit_soft_cap)

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = lax.fori_loop(lo, jnp.maximum(n_chunks, lo), body, init)
    o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _tile_plan(Q: int, Gp: int, tile_rows: int) -> int:
    """Queries per tile: a power of two with ``BQ * Gp`` in [16, max(tile_rows, Gp)], no wider than Q needs."""
    bq = max(1, tile_rows // Gp)
    bq = min(bq, _next_pow2(Q))
    return max(bq, -(-_MIN_DOT // Gp))


@functools.partial(jax.jit, static_argnames=("chunk_tokens", "tile_rows", "interpret", "num_warps", "num_stages",
                                             "sliding_window", "logit_soft_cap"))
def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *,
                            chunk_tokens: int = 64, tile_rows: int = 64, interpret: bool | None = None,
                            num_warps: int = 4, num_stages: int = 2, sliding_window: int | None = None,
                            logit_soft_cap: float | None = None):
    """Causal attention of ``Q`` queries per sequence over its paged K/V.

    q [S, Q, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D], or an 8-bit cache
    [num_blocks, block_size, KVH, D + 2] as for the decode kernel; block_tables int32
    [S, max_blocks]; context_lens, query_lens int32 [S]; scale: float or scalar array.
    Query ``i`` of sequence ``s`` sits at position ``context_lens[s] - query_lens[s] + i``.
    ``chunk_tokens``: K/V tokens per loop step (whole pages, at least 16); ``tile_rows``:
    query rows (queries x grouped heads) per program. ``interpret``: None means interpret
    on CPU. ``sliding_window``: query ``p`` sees only positions ``p - window + 1 .. p`` (chunks
    before a tile's window are skipped); ``logit_soft_cap``: scores become ``cap * tanh(scores / cap)``.
    Returns [S, Q, H, D] in q's dtype (softmax in float32); rows ``i >= query_lens[s]``
    are padding (finite, unspecified); padded sequences (length 0) give zeros.
    """
    S, Q, H, D = q.shape
    num_blocks, block_size, KVH, _ = k_cache.shape
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    check_shapes(q.shape[-2:], k_cache, v_cache, interpret)
    G = H // KVH
    Gp = _next_pow2(G)
    bq = _tile_plan(Q, Gp, tile_rows)
    n_tiles = -(-Q // bq)
    R = bq * Gp
    ppc = max(1, chunk_tokens // block_size, -(-_MIN_DOT // block_size))
    max_blocks = block_tables.shape[1]
    mbp = -(-max_blocks // ppc) * ppc

    # [S, Q, H, D] -> [S, KVH, Qp * Gp, D], row = query * Gp + head in group.
    qg = q.reshape(S, Q, KVH, G, D).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, n_tiles * bq - Q), (0, Gp - G), (0, 0))).reshape(S, KVH, n_tiles * R, D)
    # Pad the tables with the null block so every chunk's page ids are in bounds.
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, mbp - max_blocks)))
    scale_arr = jnp.asarray(scale, jnp.float32).reshape(1)
    precision = matmul_precision(q.dtype)

    kernel = functools.partial(_prefill_kernel, block_size=block_size, pages_per_chunk=ppc, queries_per_tile=bq,
                               heads_per_row=Gp, precision=precision, sliding_window=sliding_window,
                               logit_soft_cap=logit_soft_cap)
    cache_spec = pl.BlockSpec((num_blocks, block_size, None, k_cache.shape[3]), lambda s, h, t: (0, 0, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(S, KVH, n_tiles),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, t: (0,)),                     # scale
            pl.BlockSpec((1,), lambda s, h, t: (s,)),                     # context_lens
            pl.BlockSpec((1,), lambda s, h, t: (s,)),                     # query_lens
            pl.BlockSpec((None, mbp), lambda s, h, t: (s, 0)),            # block table row
            pl.BlockSpec((None, None, R, D), lambda s, h, t: (s, h, t, 0)),  # query tile
            cache_spec,                                                   # k_cache
            cache_spec,                                                   # v_cache
        ],
        out_specs=pl.BlockSpec((None, None, R, D), lambda s, h, t: (s, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((S, KVH, n_tiles * R, D), q.dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"paged_prefill_attention_bs{block_size}_ppc{ppc}_bq{bq}_gp{Gp}",
    )(scale_arr, context_lens.astype(jnp.int32), query_lens.astype(jnp.int32), bt, qg, k_cache, v_cache)

    out = out.reshape(S, KVH, n_tiles * bq, Gp, D)[:, :, :Q, :G]
    return out.transpose(0, 2, 1, 3, 4).reshape(S, Q, H, D)
