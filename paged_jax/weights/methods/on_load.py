"""Quantization as a float checkpoint loads (``quantization="int8" | "w8a8" | "fp8"``): each
linear weight of each layer becomes a :class:`~paged_jax.weights.quantized.QuantizedLinear`,
per output channel and symmetric; the embeddings and the LM head stay as they are (as vLLM's
on-load quantization leaves them)."""

from __future__ import annotations

from paged_jax.weights.dense import DenseLinear
from paged_jax.weights.quantized import FP8_MAX, QuantizedLinear

QUANTIZE_ON_LOAD = ("int8", "w8a8", "fp8")


def quantize_weight(p: DenseLinear, method: str) -> QuantizedLinear:
    """Per output channel, symmetric: int8 ``scale = max |w| / 127``, ``values = round(w / scale)``;
    fp8 ``scale = max |w| / 448``, ``values = fp8(w / scale)``. ``"w8a8"``: the int8 weight, with
    the activations quantized to int8 per token at run time (compressed-tensors' W8A8 scheme: an
    int8 x int8 matmul, which VNNI runs at 4x the float32 multiply-adds on a CPU)."""
    import jax.numpy as jnp

    w = p.w.astype(jnp.float32)
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


