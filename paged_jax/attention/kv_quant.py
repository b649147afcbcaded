"""The KV cache's dtype (``kv_cache_dtype``): ``"auto"`` the model's; ``"bfloat16"`` (beside
float32 weights: half the bytes a step reads from the cache, each entry rounded to bfloat16 as it
is written and widened again as it is read, the arithmetic staying in the model's dtype); or quantized
(``"int8" | "fp8"``): 8-bit values with one scale per token and head, kept beside the values in
the same cache array.

A bfloat16 cache beside weights of another dtype holds the bfloat16 bits in uint16 (as an fp8 one holds
its bits in uint8): XLA:CPU widens a bfloat16 scatter to float32, and converted the whole cache there and
back in every layer of every step (seconds a step); an integer scatter writes the slots alone, and a
bitcast of the whole array is a copy there too, so the readers convert what they gathered. (Beside
bfloat16 weights ``"bfloat16"`` is ``"auto"``: a bfloat16 array.)

Layout: each layer's K (and V) cache is ``[num_blocks, block_size, num_kv_heads, head_dim + 2]``
of 8-bit integers: the first ``head_dim`` bytes are the values (int8, or the bits of fp8 e4m3 in
a uint8 cache), the last two the float16 scale's bytes. A block carries its own scales, so
copy-on-write, swapping and prefix caching (which move whole blocks) need nothing new.

Why one scale per token and head: a token's K/V is written once, when it is computed, so its
scale comes from its own values (symmetric: ``max |x| / 127`` for int8, ``/ 448`` for fp8) and
never changes; a scale per block would have to be fixed before the block's later tokens exist
(a static calibrated scale) or rewrite the block when one exceeds it. It costs 2 bytes per
token and head beside ``head_dim`` bytes of values (3 % at head_dim 64).

Readers (the attention backends) gather blocks through the block table as for a float cache
and call :func:`dequantize` on what they gathered; the cache itself is never turned into
floats whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")
QUANTIZED = ("int8", "fp8")  # the kinds with a scale beside each entry
SCALE_BYTES = 2  # a float16 scale
_STORAGE = {"bfloat16": jnp.uint16, "int8": jnp.int8, "fp8": jnp.uint8}  # the cache array's dtype for each kind
_TOP = {"int8": 127.0, "fp8": 448.0}


def storage_dtype(kv_cache_dtype: str, model_dtype: str):
    """The cache array's dtype: the model's for ``"auto"``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto" or (kv_cache_dtype == "bfloat16" and jnp.dtype(model_dtype) == jnp.bfloat16):
        return jnp.dtype(model_dtype)
    return jnp.dtype(_STORAGE[kv_cache_dtype])


def cache_head_dim(head_dim: int, kv_cache_dtype: str) -> int:
    return head_dim + SCALE_BYTES if kv_cache_dtype in QUANTIZED else head_dim


def bytes_per_token_head(head_dim: int, kv_cache_dtype: str, model_bytes: int) -> int:
    """Bytes one token's K (or V) of one head takes in the cache."""
    if kv_cache_dtype in QUANTIZED:
        return head_dim + SCALE_BYTES
    return head_dim * (2 if kv_cache_dtype == "bfloat16" else model_bytes)


def kind(cache) -> str:
    """``"bfloat16"`` (bits in uint16), ``"int8"``, ``"fp8"`` or ``"auto"`` (a float cache), from the
    cache array's dtype."""
    return {jnp.dtype(s): k for k, s in _STORAGE.items()}.get(jnp.dtype(cache.dtype), "auto")


def quantize(x, storage) -> jax.Array:
    """``x [..., D]`` (float) -> the cache's entries in its ``storage`` dtype: ``[..., D]`` bfloat16
    bits (uint16), or ``[..., D + 2]`` 8-bit values and their scale (int8 or uint8)."""
    which = kind(jnp.zeros((), storage))
    if which == "bfloat16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax == 0, 1.0, amax / _TOP[which]).astype(jnp.float16)  # stored, so used to quantize
    scaled = x / scale.astype(jnp.float32)
    if which == "int8":
        values = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        values = jax.lax.bitcast_convert_type(jnp.clip(scaled, -448, 448).astype(jnp.float8_e4m3fn), jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], storage)  # [..., 2]
    return jnp.concatenate([values, scale_bytes], axis=-1)


def dequantize(x, head_dim: int, dtype=jnp.float32) -> jax.Array:
    """Gathered cache entries (``[..., D + 2]`` of an 8-bit cache, ``[..., D]`` of the others) ->
    ``[..., D]`` in ``dtype`` (a float cache: as it is)."""
    which = kind(x)
    if which == "auto":
        return x
    if which == "bfloat16":
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(dtype)
    values = x[..., :head_dim]
    if which == "fp8":
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    scale = jax.lax.bitcast_convert_type(x[..., head_dim:], jnp.float16)  # [...]
    return (values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


__all__ = ["KV_CACHE_DTYPES", "QUANTIZED", "SCALE_BYTES", "storage_dtype", "cache_head_dim", "bytes_per_token_head",
           "kind", "quantize", "dequantize"]
