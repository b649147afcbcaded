"""Quantization as a float checkpoint loads (``quantization="int8" | "w8a8" | "fp8" | "int4" |
"int4-g128"``): each linear weight of each layer becomes a
:class:`~paged_jax.weights.quantized.QuantizedLinear`, symmetric, per output channel (8 bits) or
per output channel and group of 32 or 128 input rows (4 bits); the embeddings and the LM head stay
as they are (as vLLM's on-load quantization leaves them)."""

from __future__ import annotations

from paged_jax.weights.dense import DenseLinear
from paged_jax.weights.quantized import FP8_MAX, QuantizedLinear

QUANTIZE_ON_LOAD = ("int8", "w8a8", "fp8", "int4", "int4-g128")
# 4-bit rows per scale. 32 by default, llama.cpp's q4_0 block: 16 levels cannot follow a column's
# range over hundreds of rows (an outlier takes the step of every weight in its group), and a
# float32 scale per 32 weights costs 1 bit a weight (5 in all, q4_0 4.5); "int4-g128" (GPTQ's and
# compressed-tensors' usual group) stores 4.25 bits a weight for more error.
INT4_GROUPS = {"int4": 32, "int4-g128": 128}


def _quantize_int4(w, group: int):
    """``w [K, N]`` float32 -> (values ``[K / 2, N]`` uint8, two to a byte, plus 8; scales
    ``[K / group, N]``), as llama.cpp's q4_0: in each group of each column, the weight of largest
    magnitude ``m`` gets ``-8`` (scale ``m / -8``, so the sign of a scale can be either), the rest
    ``round(w / scale)`` clipped to [-8, 7]: all 16 levels used, the largest weight exact."""
    import jax.numpy as jnp

    K, N = w.shape
    g = w.reshape(K // group, group, N)
    idx = jnp.argmax(jnp.abs(g), axis=1, keepdims=True)
    m = jnp.take_along_axis(g, idx, axis=1)[:, 0]  # [K / group, N], signed
    scale = jnp.where(m == 0, 1.0, m / -8.0)  # an all-zero group: any scale, its values are 0
    q = jnp.clip(jnp.round(g / scale[:, None]), -8, 7).astype(jnp.int32).reshape(K, N) + 8
    return (q[0::2] | (q[1::2] << 4)).astype(jnp.uint8), scale.astype(jnp.float32)


def quantize_weight(p: DenseLinear, method: str) -> QuantizedLinear:
    """Per output channel, symmetric: int8 ``scale = max |w| / 127``, ``values = round(w / scale)``;
    fp8 ``scale = max |w| / 448``, ``values = fp8(w / scale)``. ``"w8a8"``: the int8 weight, with
    the activations quantized to int8 per token at run time (compressed-tensors' W8A8 scheme: an
    int8 x int8 matmul, which VNNI runs at 4x the float32 multiply-adds on a CPU). ``"int4"`` /
    ``"int4-g128"``: 4-bit values per group of 32 / 128 input rows (:data:`INT4_GROUPS`, as q4_0);
    a weight whose inputs the group does not divide takes one group per column."""
    import jax.numpy as jnp

    w = p.w.astype(jnp.float32)
    if method in INT4_GROUPS:
        K = w.shape[0]
        group = INT4_GROUPS[method] if K % INT4_GROUPS[method] == 0 else K
        if group % 2:  # an odd number of inputs: a zero row pads the last byte (its weight is 0)
            w, group = jnp.pad(w, ((0, 1), (0, 0))), K + 1
        values, scale = _quantize_int4(w, group)
        return QuantizedLinear(values, scale, b=p.b, bits=4, in_features_=K, block=(group, 1), parallel=p.parallel)
    amax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
    if method in ("int8", "w8a8"):
        scale = jnp.where(amax == 0, 1.0, amax / 127.0)  # an all-zero column: any scale, its values are 0
        values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    elif method == "fp8":
        scale = jnp.where(amax == 0, 1.0, amax / FP8_MAX)
        values = jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    else:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZE_ON_LOAD)}, got {method!r}")
    return QuantizedLinear(values, scale, b=p.b, bits=8, in_features_=w.shape[0], parallel=p.parallel,
                           act="int8" if method == "w8a8" else None)


def quantize_layers(params: dict, method: str) -> dict:
    """Quantize on load: every float linear weight of every layer (``params["layers"]``), in place
    and one weight at a time, so each float weight can go as its quantized copy comes; the
    embeddings and the LM head stay as they are (as vLLM's on-load quantization leaves them)."""
    if method not in QUANTIZE_ON_LOAD:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZE_ON_LOAD)}, got {method!r}")
    for lp in params["layers"]:
        for key, value in lp.items():
            if isinstance(value, DenseLinear):
                lp[key] = quantize_weight(value, method)
    return params


