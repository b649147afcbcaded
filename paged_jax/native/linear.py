"""The matmuls against panel-packed weights (``linear.cc``, ``linear_quantized.cc``, ``linear_int8.cc``,
``linear_int4.cc``) through the XLA FFI,
and the panel layout they read: ``[N / W, K, W]`` column panels, each contiguous, W = 48, 32 or 16.
Each falls back to XLA's matmul on the unpacked weight where the kernel does not apply (another
platform or dtype, or the library not loaded)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from paged_jax.native import build

if TYPE_CHECKING:
    import jax


def panel_width(n: int) -> Optional[int]:
    """The widest panel (48, 32 or 16 columns) that divides ``n`` output columns; None if none does."""
    return next((w for w in build.PANEL_WIDTHS if n % w == 0), None)


def pack_weight(w) -> "jax.Array":
    """``[K, N]`` -> ``[N / W, K, W]``: W-column panels, each contiguous (W from :func:`panel_width`)."""
    import jax.numpy as jnp

    if w.ndim != 2 or panel_width(w.shape[1]) is None:
        raise ValueError(f"pack_weight takes a [K, N] matrix with N a multiple of 16; got shape {w.shape}")
    K, N = w.shape
    W = panel_width(N)
    return jnp.asarray(w).reshape(K, N // W, W).transpose(1, 0, 2)


def unpack_weight(w_panels) -> "jax.Array":
    """The inverse of :func:`pack_weight`: ``[P, K, W]`` -> ``[K, P * W]``."""
    P, K, W = w_panels.shape
    return w_panels.transpose(1, 0, 2).reshape(K, P * W)


def linear(x, w_panels) -> "jax.Array":
    """``x @ unpack_weight(w_panels)`` for ``x [..., K]``: the native kernel for float32 on a CPU
    once the kernels are registered (a runner packs only then, and keeps using them even if
    ``PAGED_JAX_NATIVE=0`` is set later), else XLA's matmul on the unpacked weight."""
    import jax
    import jax.numpy as jnp

    if w_panels.ndim != 3 or w_panels.shape[2] not in build.PANEL_WIDTHS or x.shape[-1] != w_panels.shape[1]:
        raise ValueError(f"linear takes x [..., K] and panels [P, K, W] with W in {build.PANEL_WIDTHS}; got x {x.shape}, "
                         f"panels {w_panels.shape}")
    P, K, W = w_panels.shape
    if x.dtype != jnp.float32 or w_panels.dtype != jnp.float32 or jax.default_backend() != "cpu" or \
            not build.loaded():
        return x @ unpack_weight(w_panels).astype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), K)
    build.trace("linear float32")
    y = jax.ffi.ffi_call(build.LINEAR_TARGET[0], jax.ShapeDtypeStruct((x2.shape[0], P * W), jnp.float32))(x2, w_panels)
    return y.reshape(*lead, P * W)


def linear_quantized(x, panels, scale_panels, bits: int, zero_panels=None, *, xla: bool = False) -> "jax.Array":
    """``x @ w`` for the weight held as :func:`pack_quantized` panels (rows already in the panels'
    order; int8, int4 two to a byte, or fp8 e4m3, by the panels' dtype): the native kernel for
    float32 on a CPU once the kernels are registered, else (or with ``xla``: a step with more rows
    than :func:`~paged_jax.native.build.quantized_native_rows`) XLA on the dequantized weight."""
    import jax
    import jax.numpy as jnp

    P, rows, W = panels.shape
    G = scale_panels.shape[1]
    K = rows * (2 if bits == 4 else 1)
    if x.shape[-1] != K or scale_panels.shape != (P, G, W) or \
            zero_panels is not None and zero_panels.shape != (P, G, W):
        raise ValueError(f"linear_quantized: x {x.shape}, panels {panels.shape}, scales {scale_panels.shape}, "
                         f"zeros {None if zero_panels is None else zero_panels.shape} do not fit {bits}-bit values")
    if xla or x.dtype != jnp.float32 or jax.default_backend() != "cpu" or not build.loaded():
        q = unpack_weight(panels)
        if bits == 4:
            q = jnp.stack([q & 0xF, q >> 4], axis=1).reshape(K, -1).astype(jnp.int8) - 8
        w = q.astype(jnp.float32)
        if zero_panels is not None:
            w = w - jnp.repeat(unpack_weight(zero_panels), K // G, axis=0)
        w = w * jnp.repeat(unpack_weight(scale_panels), K // G, axis=0)
        return x @ w.astype(x.dtype)
    if zero_panels is None:
        zero_panels = jnp.zeros((P, 0, W), jnp.float32)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), K)
    build.trace(f"linear {build.QUANTIZED_KERNELS[panels.dtype.name]}")
    y = jax.ffi.ffi_call(build.QUANTIZED_TARGETS[panels.dtype.name][0],
                         jax.ShapeDtypeStruct((x2.shape[0], P * W), jnp.float32))(x2, panels, scale_panels, zero_panels)
    return y.reshape(*lead, P * W)


def linear_int8(xq, x_scale, panels, sums, scales) -> "jax.Array":
    """``(xq @ w) * x_scale * w_scale`` for int8 activations ``xq`` (``[..., K]``, with their
    per-token scales ``[..., 1]``) and a weight held as :func:`pack_int8` panels: the native kernel
    on a CPU once the kernels are registered, else XLA's int8 dot on the unpacked weight. float32."""
    import jax
    import jax.numpy as jnp

    P, quads, W4 = panels.shape
    K, W = quads * 4, W4 // 4
    if xq.shape[-1] != K or xq.dtype != jnp.int8 or sums.shape != (P, W) or scales.shape != (P, W):
        raise ValueError(f"linear_int8: x {xq.shape} {xq.dtype}, panels {panels.shape}, sums {sums.shape}, "
                         f"scales {scales.shape} do not fit")
    lead = xq.shape[:-1]
    xs = x_scale.reshape(lead).astype(jnp.float32)
    if jax.default_backend() != "cpu" or not build.loaded():
        w = panels.reshape(P, quads, W, 4).transpose(1, 3, 0, 2).reshape(K, P * W)
        acc = jax.lax.dot_general(xq, w, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xs[..., None] * scales.reshape(P * W)
    m = math.prod(lead)
    build.trace("linear int8 x int8")
    y = jax.ffi.ffi_call(build.INT8_TARGET[0], jax.ShapeDtypeStruct((m, P * W), jnp.float32))(
        xq.reshape(m, K), xs.reshape(m), panels, sums, scales)
    return y.reshape(*lead, P * W)


def pack_int4_blocks(values) -> "jax.Array":
    """Symmetric 4-bit values ``[K / 2, N]`` uint8 (rows 2i and 2i + 1 in the low and high nibbles
    of byte row i, stored plus 8) as the int4 x int8 kernel's panels ``[P, K / 8, W * 4]``: rows
    eight at a time, per column four bytes, byte j holding row j in its low nibble and row 4 + j in
    its high one (so one nibble mask gives VNNI's four consecutive rows per column); columns padded
    to a panel width with zeros (value 0). K a multiple of 8."""
    import jax.numpy as jnp

    u = jnp.asarray(values)
    K, N = 2 * u.shape[0], u.shape[1]
    if u.dtype != jnp.uint8 or K % 8:
        raise ValueError(f"pack_int4_blocks takes [K / 2, N] uint8 with K a multiple of 8; got {u.shape} {u.dtype}")
    u = jnp.stack([u & 0xF, u >> 4], axis=1).reshape(K, N)  # row k's stored values (q + 8)
    W = panel_width(N) or build.PANEL_WIDTHS[0]
    u = jnp.pad(u, ((0, 0), (0, -N % W)), constant_values=8)
    u = u.reshape(K // 8, 2, 4, -1)
    blocks = (u[:, 0] | (u[:, 1] << 4)).astype(jnp.uint8)  # [K / 8, 4, N']
    return blocks.reshape(K // 8, 4, -1, W).transpose(2, 0, 3, 1).reshape(-1, K // 8, W * 4)


def unpack_int4_blocks(panels) -> "jax.Array":
    """The weight's values q (int8, [-8, 7]) ``[K, P * W]`` from :func:`pack_int4_blocks` panels."""
    import jax.numpy as jnp

    P, K8, W4 = panels.shape
    b = panels.reshape(P, K8, W4 // 4, 4).transpose(0, 1, 3, 2)  # [P, K / 8, 4, W]
    u = jnp.stack([b & 0xF, b >> 4], axis=2).reshape(P, K8 * 8, W4 // 4)
    return unpack_weight(u).astype(jnp.int8) - 8


def linear_int4(x, panels, scale_panels, *, xla: bool = False) -> "jax.Array":
    """``x @ w`` for symmetric 4-bit weights held as :func:`pack_int4_blocks` panels with scales
    ``[P, G, W]`` (groups a multiple of 32 rows): on a CPU once the kernels are registered, the int4
    x int8 kernel, which quantizes each row of x to int8 per block of 32 on the way in (llama.cpp's
    q8_0 activations against q4_0 weights: integer dot products); else (or with ``xla``) XLA's
    float32 matmul on the dequantized weight, x as it is. float32."""
    import jax
    import jax.numpy as jnp

    P, K8, W4 = panels.shape
    K, W, G = K8 * 8, W4 // 4, scale_panels.shape[1]
    if x.shape[-1] != K or K % 32 or scale_panels.shape != (P, G, W) or K % G or (K // G) % 32:
        raise ValueError(f"linear_int4: x {x.shape}, panels {panels.shape}, scales {scale_panels.shape} do not fit "
                         "(K a multiple of 32, groups of a multiple of 32 rows)")
    if xla or x.dtype != jnp.float32 or jax.default_backend() != "cpu" or not build.loaded():
        w = unpack_int4_blocks(panels).astype(jnp.float32) * jnp.repeat(unpack_weight(scale_panels), K // G, axis=0)
        return x @ w.astype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), K)
    build.trace("linear int4 x int8")
    y = jax.ffi.ffi_call(build.INT4_TARGET[0], jax.ShapeDtypeStruct((x2.shape[0], P * W), jnp.float32))(
        x2, panels, scale_panels)
    return y.reshape(*lead, P * W)


def read_sum(x) -> "jax.Array":
    """The float32 sum of ``x`` (any shape), read as the native matmul reads its weights
    (prefetched, shared over XLA's threads): the bandwidth probe of ``experiments/roofline.py``."""
    import jax
    import jax.numpy as jnp

    if x.dtype != jnp.float32:
        raise ValueError(f"read_sum takes float32, got {x.dtype}")
    return jax.ffi.ffi_call(build.SUM_TARGET[0], jax.ShapeDtypeStruct((), jnp.float32))(x)


def pack_padded(w) -> "jax.Array":
    """``[K, N]`` as panels: :func:`pack_weight` when a panel width divides N, else 48-column
    panels with N padded by zero columns (the caller cuts the outputs past N off)."""
    import jax.numpy as jnp

    if panel_width(w.shape[1]):
        return pack_weight(w)
    return pack_weight(jnp.pad(jnp.asarray(w), ((0, 0), (0, -w.shape[1] % build.PANEL_WIDTHS[0]))))
