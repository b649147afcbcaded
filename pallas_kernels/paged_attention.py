"""Paged attention DECODE kernel in Pallas (Triton backend), checked against
:func:`paged_jax.attention.reference.paged_attention_reference`.

Cache layout is the project's: ``k_cache``/``v_cache`` ``[num_blocks, block_size,
num_kv_heads, head_dim]``, block tables ``int32[S, max_blocks]`` (entry 0 is the
null block), ``context_lens int32[S]`` (0 for padded batch rows).

Grid ``(S, num_kv_heads, num_partitions)``. Program ``(s, h, p)`` takes the G
query heads that share KV head ``h`` (padded to ``Gp = max(16, pow2(G))`` rows, so
each K/V tile is loaded once for the whole group and both products are real
``[Gp, *]`` matmuls), and walks partition ``p`` of sequence ``s``'s block table:
``pages_per_partition`` table entries, consumed ``pages_per_chunk`` at a time.
Each chunk loads its page ids from the table, gathers those pages of K and V
(``k_ref[page_ids]`` on the ``[num_blocks, block_size, head_dim]`` view of head
``h``), masks token positions ``>= context_len`` and updates an online softmax in
float32. The loop's trip count is computed from ``context_len``, so pages past
the end are never read except for the tail of the last chunk (masked). The
program writes its unnormalised output, running max and running sum; a few jnp
ops merge the partitions (flash-decoding / vLLM PagedAttention V2). With
``partition_size=None`` there is a single partition (PagedAttention V1).

An 8-bit cache (``kv_cache_dtype="int8" | "fp8"``, kv_quant's layout ``[num_blocks, block_size,
num_kv_heads, head_dim + 2]``: values, then a float16 scale's bytes) is dequantized in the kernel
(``load_pages``, ``attend_chunk``); the prefill kernel shares both.

Variants (static arguments): ``logit_soft_cap`` caps the scaled scores with
``cap * tanh(s / cap)``; ``sliding_window`` hides keys more than ``window - 1`` positions
back, and the loop starts at the first chunk holding a visible key.

Backend. On CPU the kernel runs in interpret mode; on GPU it is lowered with Pallas' **Triton**
backend, chosen explicitly by passing ``jax.experimental.pallas.triton.CompilerParams``
(:func:`triton_params`). ``pallas_call`` picks its GPU lowering from the type of its compiler
params in JAX 0.10, 0.11 and 0.12. Without them, 0.10 picks Mosaic GPU (its
``jax_pallas_use_mosaic_gpu`` flag defaults to True, and Mosaic GPU through ``pallas_call`` is
deprecated there in favour of ``plgpu.kernel``); 0.11 and 0.12 have no such flag and pick Triton.
The kernels are written for Triton's programming model (one program per grid cell, gathers with
``ref[indices]``, ``tl.dot`` tiles of at least 16): Mosaic GPU would be a rewrite. JAX 0.11
deprecates the Triton backend too (a ``DeprecationWarning`` each time a kernel is lowered for a
GPU) but it still lowers the same way in 0.12.

Matmuls. Both products are ``lax.dot_general`` with explicit contracting dimensions and a float32
accumulator (:func:`dot_f32`): ``pl.dot`` raises AttributeError from JAX 0.11, while
``dot_general`` is lowered by the same Triton rule in 0.10, 0.11 and 0.12. That rule maps the
precision to ``tt.dot``'s ``input_precision``: for float32 operands ``Precision.HIGHEST`` gives
``ieee`` (full float32 products), and ``DEFAULT`` / ``HIGH`` give ``tf32`` (a 10-bit mantissa,
errors ~1e-3), as does ``None`` unless ``jax.default_matmul_precision`` says otherwise. So float32 kernels pass ``HIGHEST``
(:func:`matmul_precision`) and keep float32 accuracy on a GPU; 16-bit operands pass ``None``
(their own tensor-core products, accumulated in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

# Finite "minus infinity": used both as the initial running max and as the value of
# masked logits, so exp(m - max) is 0 and never NaN (also for rows with no tokens).
_NEG = -1e30
_MIN_DOT = 16  # Triton's tl.dot needs every matmul dimension >= 16.


def triton_params(num_warps: int, num_stages: int):
    """The compiler params that select Pallas' Triton backend on a GPU (see the module docstring)."""
    return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def matmul_precision(dtype):
    """The kernels' dot precision for operands of ``dtype``: ``HIGHEST`` for float32, so that Triton
    multiplies in IEEE float32 rather than TF32; ``None`` for 16-bit operands (native products)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot_f32(a, b, *, b_transposed: bool, precision):
    """``a [M, K]`` times ``b`` accumulated in float32: ``a @ b.T`` for ``b [N, K]`` when
    ``b_transposed``, else ``a @ b`` for ``b [K, N]``. The float32 accumulator must be asked for:
    Triton's rule accumulates float16 operands in float16 otherwise."""
    contract_b = 1 if b_transposed else 0
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _kv_quant():
    # Imported on use: paged_jax.attention imports this package (to register its backends).
    from paged_jax.attention import kv_quant

    return kv_quant


def check_shapes(heads_dim, k_cache, v_cache, interpret: bool) -> None:
    """Raise ValueError naming the bad value: ``heads_dim`` is q's (num_heads, head_dim).
    The Triton backend needs power-of-two tensor shapes; interpret mode takes any. An 8-bit
    cache (kv_quant's layout) has ``head_dim + 2`` bytes per entry: the values, then the scale; a bfloat16
    one (its bits in uint16) ``head_dim``."""
    H, D = heads_dim
    kv_quant = _kv_quant()
    quantized = kv_quant.kind(k_cache) in kv_quant.QUANTIZED  # (a bfloat16 cache's uint16 bits: head_dim)
    E = D + kv_quant.SCALE_BYTES if quantized else D
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4 or k_cache.shape[3] != E:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be [num_blocks, block_size, "
                         f"num_kv_heads, {'head_dim + 2' if quantized else 'head_dim'}={E}]")
    if H % k_cache.shape[2]:
        raise ValueError(f"num_heads={H} must be a multiple of num_kv_heads={k_cache.shape[2]}")
    block_size = k_cache.shape[1]
    if not interpret and not (_is_pow2(D) and D >= _MIN_DOT and _is_pow2(block_size)):
        raise ValueError(f"head_dim={D} must be a power of 2 >= {_MIN_DOT} and block_size={block_size} a power "
                         "of 2 for the Triton backend (interpret mode takes any)")


def visible_keys(q_pos, k_pos, length, sliding_window: int | None):
    """Which keys each query sees: [R, chunk] from q_pos [R] and k_pos [chunk] (causal, inside the
    sequence's ``length`` tokens, and within the last ``sliding_window`` positions when one is set)."""
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < length)
    if sliding_window is not None:
        seen = seen & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    return seen


def first_chunk(first_key, chunk: int):
    """Index of the chunk holding position ``first_key`` (0 when it is negative): chunks before a
    sliding window's first key are skipped, not read."""
    return jnp.maximum(first_key, 0) // chunk


def load_pages(ref, pages, chunk: int, d: int, dtype):
    """Gather ``pages`` of one head's cache view ``ref [num_blocks, block_size, E]``.

    A float cache (E = d): ``(entries [chunk, d], None)``, as stored (bfloat16 bits in uint16: in dtype). An 8-bit cache
    (kv_quant's layout, E = d + 2): ``(values [chunk, d] in dtype, scales [chunk] f32)``; the
    values (int8, or fp8 e4m3 bits in uint8) convert to ``dtype`` exactly, and the caller
    applies the scales. The float16 scale's two bytes are loaded one at a time and joined as
    an integer before a same-width bitcast: Triton's bitcast cannot turn two int8 into a float16.
    """
    if ref.shape[-1] == d:
        entries = ref[pages].reshape(chunk, d)
        if _kv_quant().kind(ref) == "bfloat16":  # bfloat16 bits in uint16, widened to the queries' dtype
            entries = lax.bitcast_convert_type(entries, jnp.bfloat16).astype(dtype)
        return entries, None
    values = ref[pages, :, pl.ds(0, d)].reshape(chunk, d)
    if _kv_quant().kind(ref) == "fp8":
        values = lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    lo, hi = (ref[pages, :, pl.ds(d + i, 1)].reshape(chunk).astype(jnp.int32) & 0xFF for i in (0, 1))
    scales = lax.bitcast_convert_type(((hi << 8) | lo).astype(jnp.uint16), jnp.float16)  # little-endian, as stored
    return values.astype(dtype), scales.astype(jnp.float32)


def attend_chunk(carry, q, k_ref, v_ref, pages, k_pos, visible, length, scale, precision,
                 logit_soft_cap: float | None = None):
    """One online-softmax step of both kernels over one chunk of pages.

    carry (o [R, D] f32 unnormalised, m [R] running max, l [R] running sum); q [R, D];
    pages [pages_per_chunk] i32 of k_ref/v_ref [num_blocks, block_size, E] (E = D, or D + 2 for
    an 8-bit cache); k_pos [chunk] the keys' positions; visible: bool broadcastable to [R, chunk];
    ``logit_soft_cap``: scores become ``cap * tanh(scores / cap)`` (after the scale, before the
    mask). Returns the new carry.
    """
    o, m, l = carry
    chunk, d = k_pos.shape[0], q.shape[1]
    k, k_scales = load_pages(k_ref, pages, chunk, d, q.dtype)
    v, v_scales = load_pages(v_ref, pages, chunk, d, q.dtype)
    s = dot_f32(q, k, b_transposed=True, precision=precision) * scale  # [R, chunk] f32
    if k_scales is not None:  # an 8-bit cache: each key's scale multiplies its scores
        s = s * k_scales[None, :]
    if logit_soft_cap is not None:
        s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
    s = jnp.where(visible, s, _NEG)
    in_seq = k_pos < length
    v = jnp.where(in_seq[:, None], v, 0)  # a stale Inf/NaN in an unused slot must not reach p @ v
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)  # rows that see nothing stay at 0
    l_new = alpha * l + p.sum(axis=-1)
    if v_scales is not None:  # ... and each value's scale its weight (l keeps the unscaled sum)
        p = p * jnp.where(in_seq, v_scales, 0.0)[None, :]
    o_new = alpha[:, None] * o + dot_f32(p.astype(v.dtype), v, b_transposed=False, precision=precision)
    return o_new, m_new, l_new


def _decode_kernel(scale_ref, len_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                   block_size: int, pages_per_chunk: int, pages_per_partition: int, precision,
                   sliding_window: int | None, logit_soft_cap: float | None):
    """One (sequence, kv head, partition).

    scale_ref [1] f32; len_ref [1] i32; bt_ref [pages_per_partition] i32;
    q_ref [Gp, D]; k_ref/v_ref [num_blocks, block_size, D] (this kv head's view);
    o_ref [Gp, D] f32 (unnormalised); m_ref, l_ref [Gp] f32.
    """
    part = pl.program_id(2)
    gp, d = q_ref.shape
    chunk = pages_per_chunk * block_size
    length = len_ref[0]
    first_page = part * pages_per_partition
    # Pages of this partition that hold at least one token < length.
    n_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_partition)
    n_chunks = pl.cdiv(n_pages, pages_per_chunk)
    q = q_ref[...]
    scale = scale_ref[0]
    q_pos = jnp.full((gp,), length - 1, jnp.int32)  # the newest token
    lo = 0 if sliding_window is None else first_chunk(length - sliding_window - first_page * block_size, chunk)

    def body(c, carry):
        pages = bt_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
        pos = (first_page + c * pages_per_chunk) * block_size + jnp.arange(chunk, dtype=jnp.int32)
        visible = visible_keys(q_pos, pos, length, sliding_window)
        return attend_chunk(carry, q, k_ref, v_ref, pages, pos, visible, length, scale, precision, logit_soft_cap)

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), _NEG, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = lax.fori_loop(lo, jnp.maximum(n_chunks, lo), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _plan(block_size: int, max_blocks: int, partition_size: int | None, chunk_tokens: int):
    """(pages_per_chunk, pages_per_partition, num_partitions)."""
    target = max(1, chunk_tokens // block_size)
    if partition_size is None:
        # Whole table in one partition; at least 16 tokens per chunk (the table is padded).
        ppc = max(min(target, _next_pow2(max_blocks)), -(-_MIN_DOT // block_size))
        ppp = -(-max_blocks // ppc) * ppc
    else:
        if partition_size % block_size:
            raise ValueError(f"partition_size={partition_size} must be a multiple of block_size={block_size}")
        ppp = partition_size // block_size
        ppc = 1
        while ppc * 2 <= target and ppp % (ppc * 2) == 0:
            ppc *= 2
    if ppc * block_size < _MIN_DOT:
        raise ValueError(f"a chunk of {ppc} pages x {block_size} tokens is under {_MIN_DOT} tokens (Triton dot "
                         f"minimum): use a partition_size that is a multiple of {_MIN_DOT}")
    return ppc, ppp, -(-max_blocks // ppp)


@functools.partial(jax.jit, static_argnames=("partition_size", "chunk_tokens", "interpret", "num_warps",
                                             "num_stages", "sliding_window", "logit_soft_cap"))
def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *,
                           partition_size: int | None = None, chunk_tokens: int = 64,
                           interpret: bool | None = None, num_warps: int = 4, num_stages: int = 2,
                           sliding_window: int | None = None, logit_soft_cap: float | None = None):
    """Decode attention of one query per sequence over its paged K/V.

    q [S, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D] (float), or an 8-bit cache in
    kv_quant's layout [num_blocks, block_size, KVH, D + 2] (int8 or fp8 values, dequantized in the
    kernel with their float16 scales); block_tables int32
    [S, max_blocks]; context_lens int32 [S]; scale: softmax scale (float or scalar array).
    ``partition_size`` (tokens, a multiple of block_size) splits each context into
    partitions run in parallel and merged (None: one partition). ``chunk_tokens``:
    tokens per inner loop step (rounded to whole pages). ``interpret``: None means
    interpret on CPU. ``sliding_window``: the query sees only the last ``sliding_window``
    positions (chunks before them are skipped); ``logit_soft_cap``: scores become
    ``cap * tanh(scores / cap)``. Returns [S, H, D] in q's dtype; softmax in float32.
    Padded rows (context_len 0) return zeros.
    """
    S, H, D = q.shape
    num_blocks, block_size, KVH, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    check_shapes((H, D), k_cache, v_cache, interpret)
    G = H // KVH
    Gp = max(_MIN_DOT, _next_pow2(G))
    ppc, ppp, P = _plan(block_size, max_blocks, partition_size, chunk_tokens)

    qg = q.reshape(S, KVH, G, D)
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    # Pad the tables with the null block so every chunk's page ids are in bounds.
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, P * ppp - max_blocks))).reshape(S, P, ppp)
    lens = context_lens.astype(jnp.int32)
    scale_arr = jnp.asarray(scale, jnp.float32).reshape(1)
    precision = matmul_precision(q.dtype)

    kernel = functools.partial(_decode_kernel, block_size=block_size, pages_per_chunk=ppc,
                               pages_per_partition=ppp, precision=precision, sliding_window=sliding_window,
                               logit_soft_cap=logit_soft_cap)
    cache_spec = pl.BlockSpec((num_blocks, block_size, None, k_cache.shape[3]), lambda s, h, p: (0, 0, h, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(S, KVH, P),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, p: (0,)),                       # scale
            pl.BlockSpec((1,), lambda s, h, p: (s,)),                       # context_lens
            pl.BlockSpec((None, None, ppp), lambda s, h, p: (s, p, 0)),     # block table partition
            pl.BlockSpec((None, None, Gp, D), lambda s, h, p: (s, h, 0, 0)),  # q group
            cache_spec,                                                     # k_cache
            cache_spec,                                                     # v_cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, D), lambda s, h, p: (s, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda s, h, p: (s, h, p, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda s, h, p: (s, h, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, KVH, P, Gp, D), jnp.float32),
            jax.ShapeDtypeStruct((S, KVH, P, Gp), jnp.float32),
            jax.ShapeDtypeStruct((S, KVH, P, Gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"paged_decode_attention_bs{block_size}_ppc{ppc}_ppp{ppp}",
    )(scale_arr, lens, bt, qg, k_cache, v_cache)

    # Merge partitions: weights exp(m_p - max_p m_p); empty rows (l == 0) give 0, not NaN.
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_max)
    l_sum = (l * w).sum(axis=2)
    o_sum = (o * w[..., None]).sum(axis=2)
    out = o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]
    return out[:, :, :G].reshape(S, H, D).astype(q.dtype)


