"""Weights stored for the native CPU matmuls (:mod:`paged_jax.native`): the same functions as
their dense or quantized sources, in column panels the kernels stream from memory.

:func:`to_panels` makes them from a model's params, by type: a float32 ``DenseLinear`` becomes a
``PanelLinear``, a ``QuantizedLinear`` the kernel takes a ``PanelQuantizedLinear`` (or, W8A8 where
the library has its VNNI or AVX2 int8 x int8 matmul, a ``PanelInt8Linear``), a tied float32
``DenseEmbedding`` a ``PanelEmbedding``. They exist only on a CPU with one device (they declare
no sharded axes); :func:`paged_jax.weights.prepare` decides when.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from paged_jax import native
from paged_jax.weights.base import map_weights, weight_class
from paged_jax.weights.dense import DenseEmbedding, DenseLinear
from paged_jax.weights.experts import ExpertStack
from paged_jax.weights.quantized import QuantizedLinear, pack_nibbles, quantize_per_token, rounded_activations

@weight_class
class PanelLinear:
    """The same function as a float32 :class:`DenseLinear`, its weight stored as column panels
    ``[P, in, W]`` for the native CPU matmul (:func:`to_panels` makes it with :func:`paged_jax.native.pack_padded`;
    output columns past ``out_features`` are zero padding and are cut off)."""

    STATIC = ("out_features", "parallel")
    AXES = {}  # one device only
    panels: Any
    b: Any = None
    out_features: int = 0
    parallel: Optional[str] = None

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    def __call__(self, x):
        y = native.linear(x, self.panels)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        return y if self.b is None else y + self.b


@weight_class
class PanelQuantizedLinear:
    """The same function as a :class:`QuantizedLinear` of int8, int4 or fp8 values with scales (and
    zero points) per column and group of rows, stored as column panels for the native CPU matmul
    (:func:`pack_quantized` makes it; a step with more rows than
    :func:`~paged_jax.native.quantized_native_rows` runs XLA's dequantize-then-matmul on them
    instead, the faster there): values ``[P, in, W]`` int8 or float8, or
    ``[P, in / 2, W]`` uint8, scales ``[P, groups, W]`` float32, zeros the same or None; columns
    past ``out_features`` are padding and are cut off. ``order``: for a weight in activation
    order, the original row of each packed row (its groups made contiguous): the input's
    features are taken in that order."""

    STATIC = ("bits", "act", "out_features", "parallel", "int8_activations")
    AXES = {}  # one device only
    panels: Any
    scales: Any
    zeros: Any = None
    order: Any = None
    b: Any = None
    bits: int = 8
    act: Optional[str] = None
    out_features: int = 0
    parallel: Optional[str] = None
    # symmetric 4 bits as paged_jax.native.pack_int4_blocks panels [P, in / 8, W * 4], multiplied by
    # the int4 x int8 kernel (the activations quantized to int8 per block of 32, as llama.cpp's q8_0)
    int8_activations: bool = False

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * (8 if self.int8_activations else 2 if self.bits == 4 else 1)

    @property
    def kernel(self) -> str:
        """Which native matmul multiplies it (the key of :func:`~paged_jax.native.quantized_native_rows`)."""
        return "int4 x int8" if self.int8_activations else native.QUANTIZED_KERNELS[self.panels.dtype.name]

    def __call__(self, x):
        dtype = x.dtype
        if self.act is not None:  # as QuantizedLinear: the rounded activations, multiplied in float32
            x = rounded_activations(x, self.act)
        if self.order is not None:
            x = jnp.take(x, self.order, axis=-1)
        # past so many rows (a long prefill chunk) XLA's dequantize-then-matmul is the faster, on some builds
        limit = native.quantized_native_rows(self.kernel)
        xla = limit is not None and math.prod(x.shape[:-1]) > limit
        if self.int8_activations:
            y = native.linear_int4(x, self.panels, self.scales, xla=xla)
        else:
            y = native.linear_quantized(x, self.panels, self.scales, self.bits, self.zeros, xla=xla)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        y = y.astype(dtype)
        return y if self.b is None else y + self.b


@weight_class
class PanelInt8Linear:
    """The same function as a W8A8 :class:`QuantizedLinear` (int8 weights with a scale per column,
    activations quantized to int8 per token at run time) stored for the native int8 x int8 matmul
    (:func:`pack_int8` makes it): panels ``[P, in / 4, W * 4]`` int8 (rows
    interleaved four at a time per column), each column's sum ``[P, W]`` int32 and scale ``[P, W]``
    float32; columns past ``out_features`` are padding and are cut off."""

    STATIC = ("out_features", "parallel")
    AXES = {}  # one device only
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
        xq, xs = quantize_per_token(x, "int8")
        y = native.linear_int8(xq, xs, self.panels, self.sums, self.scales)[..., :self.out_features].astype(x.dtype)
        return y if self.b is None else y + self.b


@weight_class
class PanelEmbedding:
    """A tied embedding stored once, as the LM head's panels ``[P, hidden, W]`` for the native
    matmul (``table.T`` packed, vocabulary padded past ``vocab_size``); lookups read the same
    panels (row v in panel v // W, column v % W), so there is no second copy."""

    STATIC = ("vocab_size", "tied", "parallel")
    AXES = {}  # one device only
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
        return native.linear(h, self.panels)[..., :self.vocab_size]


@weight_class
class PanelExpertStack:
    """A float32 ``ExpertStack(DenseLinear)`` as each expert's weight in column panels,
    ``panels [E, P, in, W]`` (:func:`paged_jax.native.pack_padded` per expert; output columns past
    ``out_features`` are padding, cut off), and its biases ``b [E, out]`` or None."""

    STATIC = ("out_features", "parallel")
    AXES = {}  # one device only
    panels: Any
    b: Any = None
    out_features: int = 0
    parallel: Optional[str] = None

    @classmethod
    def pack(cls, stack: ExpertStack) -> "PanelExpertStack":
        w = stack.linear.w
        return cls(jnp.stack([native.pack_padded(w[e]) for e in range(w.shape[0])]), stack.linear.b,
                   out_features=w.shape[2])

    @property
    def num_experts(self) -> int:
        return self.panels.shape[0]

    def grouped(self, rows, offsets):
        """``rows [M, in]`` sorted by expert, expert ``e``'s at ``offsets[e]`` .. ``offsets[e + 1]``
        (``offsets [E + 1]``; rows past ``offsets[E]`` give 0) -> ``[M, out]`` float32."""
        from paged_jax.native.grouped import grouped_linear

        y = grouped_linear(rows.astype(jnp.float32), offsets, self.panels)
        y = y if y.shape[-1] == self.out_features else y[:, :self.out_features]
        if self.b is None:
            return y
        E = self.num_experts
        expert = jnp.searchsorted(offsets, jnp.arange(rows.shape[0]), side="right") - 1  # E: past the last
        return y + jnp.where((expert < E)[:, None], self.b[jnp.minimum(expert, E - 1)], 0).astype(jnp.float32)

    def __getitem__(self, e):
        return PanelLinear(self.panels[e], None if self.b is None else self.b[e], out_features=self.out_features)

    def __call__(self, xs):
        E, rows, _ = xs.shape
        y = self.grouped(xs.reshape(E * rows, -1), jnp.arange(E + 1, dtype=jnp.int32) * rows)
        return y.reshape(E, rows, -1)


def experts_packable(stack) -> bool:
    """Whether :meth:`PanelExpertStack.pack` takes ``stack``: float32 dense experts (biases or not)."""
    return isinstance(stack, ExpertStack) and isinstance(stack.linear, DenseLinear) and stack.linear.w.ndim == 3 \
        and stack.linear.w.dtype == jnp.float32


def quantized_packable(p: QuantizedLinear) -> bool:
    """Whether :func:`pack_quantized` takes a ``QuantizedLinear``: int8, int4 or fp8 e4m3 values
    with scales (and optionally zero points) per block of whole groups of rows (an even count for
    int4) and any columns (per column, per tensor, 2-D blocks), the groups contiguous or in
    activation order (``g_idx``: then every group must have as many rows as the others, as GPTQ
    writes them). Activations quantized at run time are taken where the weight's own matmul
    quantizes them and multiplies in float32 (W8A8 with int8 weights per column is an integer
    matmul: :func:`int8_packable`)."""
    fmt = {jnp.dtype(jnp.int8): 8, jnp.dtype(jnp.uint8): 4, jnp.dtype(jnp.float8_e4m3fn): 8}.get(p.values.dtype)
    if fmt is None or fmt != p.bits:
        return False
    n_in, n_out = p.in_features, p.values.shape[1]
    rows, cols = p._block(n_out)
    groups = p.scale.shape[0]
    if p.integer_matmul:  # W8A8 per column: an integer matmul (pack_int8, or XLA's)
        return False
    if p.zero is not None and p.zero.shape != p.scale.shape:
        return False
    if p.g_idx is not None:
        g_idx = np.asarray(p.g_idx)
        if g_idx.shape != (n_in,) or g_idx.min() < 0 or g_idx.max() >= groups or \
                not np.all(np.bincount(g_idx, minlength=groups) == rows):
            return False
    return rows * groups == n_in and cols * p.scale.shape[1] >= n_out and (p.bits == 8 or rows % 2 == 0)


def pack_quantized(p: QuantizedLinear):
    """A ``QuantizedLinear`` (see :func:`quantized_packable`) as (value panels ``[P, K', W]``, scale
    panels ``[P, G, W]`` float32, zero-point panels shaped as the scales (float32, in the values'
    units) or None, the row order or None), output columns padded to a panel width. A weight in
    activation order has its rows sorted by group (stably): row ``i`` of the packed weight is
    row ``order[i]`` of the original, so ``x[..., order] @ packed == x @ original``."""
    n_out = p.values.shape[1]
    cols = p._block(n_out)[1]
    values, order = p.values, None
    if p.g_idx is not None:
        order = np.argsort(np.asarray(p.g_idx), kind="stable").astype(np.int32)
        sorted_rows = np.asarray(p.unpacked())[order]
        values = pack_nibbles(sorted_rows) if p.bits == 4 else sorted_rows
        order = jnp.asarray(order)

    def per_column(a):  # [G, column blocks] -> [G, n_out] float32
        return jnp.repeat(a.astype(jnp.float32), cols, axis=1)[:, :n_out]

    zero = None if p.zero is None else native.pack_padded(per_column(p.zero))
    return native.pack_padded(jnp.asarray(values)), native.pack_padded(per_column(p.scale)), zero, order


def int4_int8_packable(p: QuantizedLinear) -> bool:
    """Whether the int4 x int8 kernel takes a :func:`quantized_packable` weight: symmetric 4 bits
    (no zero points), no activation rounding of its own, inputs and groups of rows multiples of 32
    (q8_0's activation block)."""
    return p.bits == 4 and p.zero is None and p.act is None and p.in_features % 32 == 0 and \
        p._block(p.values.shape[1])[0] % 32 == 0 and quantized_packable(p)


def int8_packable(p: QuantizedLinear) -> bool:
    """Whether :func:`pack_int8` takes a ``QuantizedLinear``: W8A8 (int8 activations per token,
    ``act="int8"``) with int8 weights and one scale per column or for the tensor, no zero points
    or activation order, and inputs a multiple of 4."""
    return p.integer_matmul and p.in_features % 4 == 0 and p.values.shape[0] == p.in_features


def pack_int8(p: QuantizedLinear):
    """A W8A8 ``QuantizedLinear`` (see :func:`int8_packable`) as (panels ``[P, K / 4, W * 4]`` int8,
    each panel's rows interleaved four at a time per column, VNNI's operand layout; column sums
    ``[P, W]`` int32; scales ``[P, W]`` float32), output columns padded to a panel width."""
    K, n_out = p.values.shape
    panels = native.pack_padded(p.values)  # [P, K, W], rows 4i .. 4i + 3 of a column then interleaved
    P, _, W = panels.shape
    panels = panels.reshape(P, K // 4, 4, W).transpose(0, 1, 3, 2).reshape(P, K // 4, W * 4)
    sums = native.pack_padded(jnp.sum(p.values, axis=0, dtype=jnp.int32)[None])[:, 0]
    scales = native.pack_padded(jnp.broadcast_to(p.scale.astype(jnp.float32), (1, n_out)))[:, 0]
    return panels, sums, scales


def to_panels(params, floats: bool = True, int8: Optional[bool] = None, int4_int8: bool = False):
    """A copy of a model's params with each weight object the native kernels take stored as
    panels (by type, not by name; everything else stays as it was). ``floats=False``: the
    quantized weights only (without AVX-512 or AVX2 the float matmul's portable loops are slower than
    XLA's; the quantized one's are still far faster than XLA's dequantize-then-dot). ``int8``: W8A8
    weights to the int8 x int8 kernel (default: where the library was built with its integer tiles,
    AVX-512 VNNI or AVX2's vpmaddwd; its portable loops are slower than float32). ``int4_int8``:
    symmetric int4 weights to the int4 x int8 kernel (:func:`int4_int8_packable`), the activations
    quantized to int8 per block of 32 as llama.cpp's q8_0 (``quantization="int4"`` on load asks for
    it; a W4A16 checkpoint keeps its activations, the float32 kernel)."""
    if int8 is None:
        int8 = bool(native.status().get("int8_matmul"))

    def pack(x):
        if isinstance(x, QuantizedLinear) and int8 and int8_packable(x):
            panels, sums, scales = pack_int8(x)
            return PanelInt8Linear(panels, sums, scales, x.b, out_features=x.values.shape[1], parallel=x.parallel)
        if isinstance(x, QuantizedLinear) and quantized_packable(x):
            panels, scales, zeros, order = pack_quantized(x)
            blocks = int4_int8 and int4_int8_packable(x)
            if blocks:  # the same values, regrouped for the integer kernel
                panels = native.pack_int4_blocks(native.unpack_weight(panels))
            return PanelQuantizedLinear(panels, scales, zeros, order, x.b, bits=x.bits, act=x.act,
                                        out_features=x.values.shape[1], parallel=x.parallel, int8_activations=blocks)
        if floats and isinstance(x, DenseLinear) and x.w.ndim == 2 and x.w.dtype == jnp.float32:
            return PanelLinear(native.pack_padded(x.w), x.b, out_features=x.w.shape[1], parallel=x.parallel)
        if floats and experts_packable(x):  # a mixture's float32 experts: the native grouped matmul
            return PanelExpertStack.pack(x)
        if floats and isinstance(x, DenseEmbedding) and x.tied and x.table.dtype == jnp.float32:
            return PanelEmbedding(native.pack_padded(x.table.T), vocab_size=x.table.shape[0], parallel=x.parallel)
        return x

    return map_weights(pack, params)
