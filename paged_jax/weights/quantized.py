"""Quantized linear weights in XLA: ``QuantizedLinear`` (int8, fp8 or packed int4 values with
scales per tensor, channel, group or block, optional zero points and activation order) and the
per-token activation quantization of W8A8 / FP8 checkpoints. Every checkpoint reader
(:mod:`paged_jax.weights.methods`) and on-load quantization make this one class."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.weights.base import check_role, weight_class

ACTIVATION_QUANT = (None, "int8", "fp8")
FP8_MAX = 448.0  # the largest float8_e4m3fn


def _expand(s, n: int, axis: int, size: int):
    """Scales per group of ``size`` indices along ``axis`` -> one per index (``n`` of them; the
    last group may be partial)."""
    if s.shape[axis] == n:
        return s
    return jax.lax.slice_in_dim(jnp.repeat(s, size, axis=axis), 0, n, axis=axis)


def _exact_div(a, b):
    """``a / b`` rounded once, as IEEE (and torch) divide. XLA rewrites a division by a constant or
    by a broadcast into a multiplication by the reciprocal, a second rounding that moves a value
    sitting exactly on a .5 (the largest of each token, at 127.5) to the other integer."""
    a, b = jnp.broadcast_arrays(a, b)
    return a / jax.lax.optimization_barrier(b)


def quantize_per_token(x, act: str):
    """Round ``x`` (``[..., in]``) to int8 or fp8 with one scale per token (symmetric, as
    compressed-tensors' dynamic activation quantization: int8 ``max|x| / 127.5`` rounded half to
    even into [-128, 127], fp8 ``max|x| / 448``); returns (values in their own dtype, float32
    scales ``[..., 1]``)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    top = 127.5 if act == "int8" else FP8_MAX
    scale = jnp.where(amax == 0, jnp.finfo(jnp.float32).eps, _exact_div(amax, jnp.float32(top)))
    scaled = _exact_div(x, scale)
    if act == "int8":
        return jnp.clip(jnp.round(scaled), -128, 127).astype(jnp.int8), scale
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


def rounded_activations(x, act: str):
    """``x`` quantized per token (:func:`quantize_per_token`) and turned back into float32: what
    a weight with activations quantized at run time multiplies when its matmul is a float one."""
    xq, xs = quantize_per_token(x, act)
    return xq.astype(jnp.float32) * xs


@weight_class
class QuantizedLinear:
    """``x @ w (+ b)`` with ``w = (values - zero) * scale`` stored quantized, ``[in, out]`` as
    :class:`DenseLinear`:

    - ``values``: int8 (8-bit), float8_e4m3fn (fp8), or uint8 holding two 4-bit values per byte
      (``bits == 4``: rows ``2i`` in the low nibble and ``2i + 1`` in the high one, each stored
      plus 8, so ``[ceil(in / 2), out]``);
    - ``scale``: float32 ``[G_in, G_out]``, one per ``block`` (rows x columns) of the weight:
      ``[1, 1]`` per tensor, ``[1, out]`` per output channel, ``[ceil(in / group), out]`` per group
      of inputs, or 2-D blocks;
    - ``zero``: int8 zero points shaped as ``scale`` (asymmetric), or None;
    - ``g_idx``: int32 ``[in]``, the scale row of each input row (activation order), or None
      (groups are contiguous);
    - ``act``: ``"int8"`` / ``"fp8"``: activations are quantized per token at run time (W8A8
      checkpoints), so the numbers are the checkpoint's own.

    The matmul dequantizes in XLA (``dequantize``), except int8 x int8 with per-channel weights,
    which is an integer matmul scaled afterwards."""

    STATIC = ("bits", "in_features_", "block", "act", "parallel")
    # scale / zero ([G_in, G_out]) split where the mesh divides their groups (any placement gives the
    # same numbers: the step is written for the global arrays); g_idx stays whole
    AXES = {"values": ("in", "out"), "scale": ("in", "out"), "zero": ("in", "out"), "b": ("out",)}
    values: Any
    scale: Any
    zero: Any = None
    g_idx: Any = None
    b: Any = None
    bits: int = 8
    in_features_: int = 0
    block: Optional[tuple] = None  # (rows, columns) each scale covers; None: the scale's shape divides the weight
    act: Optional[str] = None
    parallel: Optional[str] = None

    def __post_init__(self):
        check_role(self.parallel)
        if self.act not in ACTIVATION_QUANT:
            raise ValueError(f"act must be one of {ACTIVATION_QUANT}, got {self.act!r}")

    @property
    def in_features(self) -> int:
        return self.in_features_

    @property
    def integer_matmul(self) -> bool:
        """int8 activations against int8 weights with one scale per column (or the tensor): an
        integer matmul scaled afterwards; other activation schemes multiply in float32."""
        return (self.act == "int8" and self.bits == 8 and self.values.dtype == jnp.int8 and self.scale.shape[0] == 1
                and self.zero is None and self.g_idx is None)

    def unpacked(self):
        """The values ``[in, out]`` in int8 or float8 (4-bit ones unpacked and centred)."""
        if self.bits != 4:
            return self.values
        v = self.values
        pairs = jnp.stack([v & 0xF, v >> 4], axis=1).astype(jnp.int8)  # [in/2, 2, out]
        return pairs.reshape(-1, v.shape[-1])[:self.in_features_] - 8

    def _block(self, n_out: int) -> tuple:
        return self.block or (self.in_features_ // self.scale.shape[0], n_out // self.scale.shape[1])

    def dequantize(self, dtype=jnp.float32):
        """The float weight ``[in, out]`` this object stands for."""
        q = self.unpacked().astype(jnp.float32)
        n_in, n_out = q.shape
        rows, cols = self._block(n_out)
        scale, zero = self.scale.astype(jnp.float32), self.zero
        if self.g_idx is not None:
            scale = scale[self.g_idx]
            zero = None if zero is None else zero[self.g_idx]
        scale = _expand(_expand(scale, n_in, 0, rows), n_out, 1, cols)
        if zero is not None:
            q = q - _expand(_expand(zero.astype(jnp.float32), n_in, 0, rows), n_out, 1, cols)
        return (q * scale).astype(dtype)

    def __call__(self, x):
        dtype = x.dtype
        if self.integer_matmul:
            xq, xs = quantize_per_token(x, self.act)
            acc = jax.lax.dot_general(xq, self.values, (((xq.ndim - 1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.int32)
            n_out = acc.shape[-1]
            y = acc.astype(jnp.float32) * xs * _expand(self.scale.astype(jnp.float32), n_out, 1,
                                                       self._block(n_out)[1])[0]
        elif self.act is not None:
            y = rounded_activations(x, self.act) @ self.dequantize(jnp.float32)
        else:
            y = x @ self.dequantize(dtype)
        y = y.astype(dtype)
        return y if self.b is None else y + self.b


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """int4 values ``[in, out]`` -> uint8 ``[ceil(in / 2), out]`` (QuantizedLinear's layout)."""
    u = (values.astype(np.int16) + 8).astype(np.uint8)
    if u.shape[0] % 2:
        u = np.concatenate([u, np.full((1, u.shape[1]), 8, np.uint8)])
    return u[0::2] | (u[1::2] << 4)
