"""The ragged paged attention kernel (``paged_attention.cc``) through the XLA FFI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from paged_jax.native import build

if TYPE_CHECKING:
    import jax


def _dtype(q, k_cache, v_cache) -> Optional[str]:
    """The one dtype of the three operands when the kernel has a variant for it, else None."""
    dtypes = {str(x.dtype) for x in (q, k_cache, v_cache)}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(build.TARGETS) else None


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, sliding_window: Optional[int] = None,
                 logit_soft_cap: Optional[float] = None, sinks=None) -> "jax.Array":
    """Same contract as :func:`paged_jax.attention.decode.paged_decode_attention`: one query per row
    (:func:`paged_attention` with rows of one query each); rows with ``context_lens <= 0`` give zeros."""
    import jax.numpy as jnp

    S = q.shape[0] if q.ndim == 3 else -1
    context_lens = jnp.asarray(context_lens)
    return paged_attention(q, k_cache, v_cache, block_tables, context_lens, jnp.arange(max(S, 0), dtype=jnp.int32),
                           (context_lens > 0).astype(jnp.int32), scale, sliding_window, logit_soft_cap, sinks)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_starts, query_lens, scale: float,
                    sliding_window: Optional[int] = None, logit_soft_cap: Optional[float] = None,
                    sinks=None) -> "jax.Array":
    """Causal attention of token-flat queries over the paged cache, a whole ragged step at once.

    q ``[T, H, D]``; row ``s`` (of ``block_tables [S, max_blocks]``) owns the ``query_lens[s]``
    tokens from ``query_starts[s]``, its ``i``-th at position ``context_lens[s] - query_lens[s] + i``,
    which sees that row's keys up to its position (and, with ``sliding_window``, after its position
    less the window; ``logit_soft_cap``: scores become ``cap * tanh(scores / cap)``; ``sinks``: float32 ``[H]``
    sink logits, one more term ``exp(sink)`` in each softmax's denominator). Returns ``[T, H, D]``; tokens no row owns are
    zeros. float32 or bfloat16, one dtype for all three; or, with any query dtype, bfloat16 caches held
    as their bits in uint16 or 8-bit caches (int8 or fp8), in kv_quant's layouts; float32 arithmetic."""
    import jax
    import jax.numpy as jnp

    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape or block_tables.ndim != 2 or \
            0 in k_cache.shape[:3]:
        raise ValueError(f"paged_attention takes q [T, H, D], caches [blocks, block_size, kv_heads, D] and tables "
                         f"[S, max_blocks]; got q {q.shape}, k {k_cache.shape}, v {v_cache.shape}, "
                         f"tables {block_tables.shape}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"paged_attention: sliding_window must be None or an integer >= 1, got {sliding_window!r}")
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"paged_attention: logit_soft_cap must be None or > 0, got {logit_soft_cap!r}")
    attrs = dict(scale=np.float32(scale), window=np.int64(sliding_window or 0), soft_cap=np.float32(logit_soft_cap or 0))
    T, H, D = q.shape
    S, KVH = block_tables.shape[0], k_cache.shape[2]
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    if sinks.shape not in ((0,), (H,)):
        raise ValueError(f"paged_attention: sinks need one logit per query head ({H},), got {sinks.shape}")
    rows = [jnp.asarray(x).astype(jnp.int32) for x in (block_tables, context_lens, query_starts, query_lens)]
    if any(x.shape != (S,) for x in rows[1:]):
        got = ", ".join(f"{name} {tuple(x.shape)}" for name, x in zip(("context_lens", "query_starts", "query_lens"), rows[1:]))
        raise ValueError(f"paged_attention: {S} rows of tables need context_lens, query_starts and query_lens of "
                         f"shape ({S},); got {got}")
    quantized = build.QUANTIZED_ATTENTION_TARGETS.get(str(k_cache.dtype))
    if quantized and v_cache.dtype == k_cache.dtype:  # an 8-bit cache: D values + a float16 scale
        if k_cache.shape[3] != D + 2 or H % KVH:
            raise ValueError(f"paged_attention over an 8-bit cache needs entries of head_dim + 2 = {D + 2} and kv_heads "
                             f"dividing {H}; got k {k_cache.shape}")
        build.trace("attention int8 cache" if str(k_cache.dtype) == "int8" else "attention fp8 cache")
        out = jax.ffi.ffi_call(quantized[0], jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q.astype(jnp.float32), k_cache, v_cache, *rows, sinks, **attrs)
        return out.astype(q.dtype)
    if k_cache.shape[3] != D or H % KVH:
        raise ValueError(f"paged_attention: {H} query heads of {D} need kv_heads dividing {H} and head_dim {D}; got "
                         f"k {k_cache.shape}")
    if k_cache.dtype == v_cache.dtype == jnp.uint16:  # bfloat16 bits (kv_cache_dtype="bfloat16", kv_quant)
        build.trace("attention bfloat16 cache")
        out = jax.ffi.ffi_call(build.WIDENED_ATTENTION_TARGET[0], jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q.astype(jnp.float32), k_cache, v_cache, *rows, sinks, **attrs)
        return out.astype(q.dtype)
    dtype = _dtype(q, k_cache, v_cache)
    if dtype is None:
        raise ValueError(f"paged_attention takes {' or '.join(build.TARGETS)} for q and both caches alike (or "
                         f"uint16 / int8 / uint8 caches in kv_quant's layouts); got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    build.trace(f"attention {dtype}")
    return jax.ffi.ffi_call(build.TARGETS[dtype][0], jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_cache, v_cache, *rows, sinks, **attrs)
