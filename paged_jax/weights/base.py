"""Weight objects: each owns its storage layout and its matmul.

Model code calls ``linear(x, p)`` and ``embedding.lookup(ids)`` / ``embedding.logits(h)``
whatever the storage is. Each class is a JAX pytree (a registered dataclass): its arrays
are children, its layout facts are static. The family chooses each weight's ``parallel``
role when it builds the params, and :mod:`paged_jax.parallel.rules` reads it:

- ``"column"``: output columns split over the ``tp`` axis (Q, gate/up, fc1, an untied LM head);
- ``"kv"``: like ``"column"``, for the K/V projections (repeated first when ``tp`` exceeds the KV heads);
- ``"row"``: input rows split (attention output, down, fc2), the bias added once after the all-reduce;
- ``"vocab"``: an embedding table split over its vocabulary rows;
- ``None``: replicated.

A storage format is one more class here with its own ``__call__`` (``QuantizedLinear``: int8,
fp8 or packed int4 values with scales per tensor, channel, group or block), and converters that
make it (:mod:`paged_jax.models.quantization` from a checkpoint or on load,
:func:`paged_jax.native.pack_params`); model code does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

PARALLEL_ROLES = (None, "column", "kv", "row", "vocab")


def _pytree(cls):
    """A frozen dataclass registered as a pytree: fields named in ``cls.STATIC`` are static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    meta = [f for f in fields if f in cls.STATIC]
    return jax.tree_util.register_dataclass(cls, data_fields=[f for f in fields if f not in meta], meta_fields=meta)


def _check_role(role):
    if role not in PARALLEL_ROLES:
        raise ValueError(f"parallel must be one of {PARALLEL_ROLES}, got {role!r}")


@_pytree
class DenseLinear:
    """``x @ w (+ b)``, ``w`` stored ``[in, out]`` (XLA's matmul)."""

    STATIC = ("parallel",)
    w: Any
    b: Any = None
    parallel: Optional[str] = None

    def __post_init__(self):
        _check_role(self.parallel)

    @property
    def in_features(self) -> int:
        return self.w.shape[0]

    def __call__(self, x):
        y = x @ self.w
        return y if self.b is None else y + self.b


@_pytree
class PanelLinear:
    """The same function as a float32 :class:`DenseLinear`, its weight stored as column panels
    ``[P, in, W]`` for the native CPU matmul (:func:`paged_jax.native.pack_linear` makes it;
    output columns past ``out_features`` are zero padding and are cut off)."""

    STATIC = ("out_features", "parallel")
    panels: Any
    b: Any = None
    out_features: int = 0
    parallel: Optional[str] = None

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    def __call__(self, x):
        from paged_jax import native

        y = native.linear(x, self.panels)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        return y if self.b is None else y + self.b


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


@_pytree
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
        _check_role(self.parallel)
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


@_pytree
class PanelQuantizedLinear:
    """The same function as a :class:`QuantizedLinear` of int8, int4 or fp8 values with scales (and
    zero points) per column and group of rows, stored as column panels for the native CPU matmul
    (:func:`paged_jax.native.pack_quantized` makes it): values ``[P, in, W]`` int8 or float8, or
    ``[P, in / 2, W]`` uint8, scales ``[P, groups, W]`` float32, zeros the same or None; columns
    past ``out_features`` are padding and are cut off. ``order``: for a weight in activation
    order, the original row of each packed row (its groups made contiguous): the input's
    features are taken in that order."""

    STATIC = ("bits", "act", "out_features", "parallel")
    panels: Any
    scales: Any
    zeros: Any = None
    order: Any = None
    b: Any = None
    bits: int = 8
    act: Optional[str] = None
    out_features: int = 0
    parallel: Optional[str] = None

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * (2 if self.bits == 4 else 1)

    def __call__(self, x):
        from paged_jax import native

        dtype = x.dtype
        if self.act is not None:  # as QuantizedLinear: the rounded activations, multiplied in float32
            x = rounded_activations(x, self.act)
        if self.order is not None:
            x = jnp.take(x, self.order, axis=-1)
        y = native.linear_quantized(x, self.panels, self.scales, self.bits, self.zeros)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        y = y.astype(dtype)
        return y if self.b is None else y + self.b


@_pytree
class PanelInt8Linear:
    """The same function as a W8A8 :class:`QuantizedLinear` (int8 weights with a scale per column,
    activations quantized to int8 per token at run time) stored for the native int8 x int8 matmul
    (:func:`paged_jax.native.pack_int8` makes it): panels ``[P, in / 4, W * 4]`` int8 (rows
    interleaved four at a time per column), each column's sum ``[P, W]`` int32 and scale ``[P, W]``
    float32; columns past ``out_features`` are padding and are cut off."""

    STATIC = ("out_features", "parallel")
    panels: Any
    sums: Any
    scales: Any
    b: Any = None
    out_features: int = 0
    parallel: Optional[str] = None

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * 4

    def __call__(self, x):
        from paged_jax import native

        xq, xs = quantize_per_token(x, "int8")
        y = native.linear_int8(xq, xs, self.panels, self.sums, self.scales)[..., :self.out_features].astype(x.dtype)
        return y if self.b is None else y + self.b


@_pytree
class DenseEmbedding:
    """A token table ``[vocab, hidden]``; ``tied``: it is the LM head too (logits ``h @ table.T``)."""

    STATIC = ("tied", "parallel")
    table: Any
    tied: bool = False
    parallel: Optional[str] = "vocab"

    def __post_init__(self):
        _check_role(self.parallel)

    def lookup(self, ids):
        return self.table[ids]

    def logits(self, h):
        return h @ self.table.T


@_pytree
class PanelEmbedding:
    """A tied embedding stored once, as the LM head's panels ``[P, hidden, W]`` for the native
    matmul (``table.T`` packed, vocabulary padded past ``vocab_size``); lookups read the same
    panels (row v in panel v // W, column v % W), so there is no second copy."""

    STATIC = ("vocab_size", "tied", "parallel")
    panels: Any
    vocab_size: int = 0
    tied: bool = True
    parallel: Optional[str] = None

    def lookup(self, ids):
        # the rows DenseEmbedding.lookup gives: negative ids from the end, then clamped
        ids = jnp.clip(jnp.where(ids < 0, ids + self.vocab_size, ids), 0, self.vocab_size - 1)
        W = self.panels.shape[2]
        return self.panels[ids // W, :, ids % W]

    def logits(self, h):
        from paged_jax import native

        return native.linear(h, self.panels)[..., :self.vocab_size]


LINEAR_TYPES = (DenseLinear, PanelLinear, QuantizedLinear, PanelQuantizedLinear, PanelInt8Linear)
EMBEDDING_TYPES = (DenseEmbedding, PanelEmbedding)
WEIGHT_TYPES = LINEAR_TYPES + EMBEDDING_TYPES


def is_weight(x) -> bool:
    return isinstance(x, WEIGHT_TYPES)


def linear(x, p):
    """Apply a linear weight object (any storage format)."""
    return p(x)


def map_weights(fn, params):
    """A copy of ``params`` (nested dicts, lists, tuples) with every weight object ``w`` replaced by
    ``fn(w)``; other leaves are kept, and so is the order of dict keys (``jax.tree_util.tree_map``
    would sort them)."""
    if is_weight(params):
        return fn(params)
    if isinstance(params, dict):
        return {k: map_weights(fn, v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(map_weights(fn, v) for v in params)
    return params


__all__ = ["DenseLinear", "PanelLinear", "QuantizedLinear", "PanelQuantizedLinear", "PanelInt8Linear", "quantize_per_token",
           "rounded_activations", "ACTIVATION_QUANT",
           "DenseEmbedding", "PanelEmbedding", "LINEAR_TYPES", "EMBEDDING_TYPES",
           "WEIGHT_TYPES", "PARALLEL_ROLES", "is_weight", "linear", "map_weights"]
