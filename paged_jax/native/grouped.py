"""The grouped matmul of a mixture's experts (``grouped_linear.cc``) through the XLA FFI: rows
sorted by expert, each expert's rows times its own panel-packed weight, in one call."""

from __future__ import annotations

from paged_jax.native import build


def grouped_linear(x, offsets, w_panels):
    """``y[r] = x[r] @ unpack_weight(w_panels[e])`` for the rows ``offsets[e] <= r < offsets[e + 1]``
    of expert ``e``, zero for the rows past ``offsets[E]``. x ``[M, K]`` float32, offsets
    ``[E + 1]`` int32 (ascending from 0), ``w_panels`` ``[E, P, K, W]`` (each expert's
    :func:`~paged_jax.native.pack_weight`). The native kernel for float32 on a CPU once the kernels
    are registered; else XLA (every expert over every row, masked: a fallback, E times the work)."""
    import jax
    import jax.numpy as jnp

    E, P, K, W = w_panels.shape
    if x.ndim != 2 or x.shape[1] != K or offsets.shape != (E + 1,) or W not in build.PANEL_WIDTHS:
        raise ValueError(f"grouped_linear takes x [M, K], offsets [E + 1] and panels [E, P, K, W] with W in "
                         f"{build.PANEL_WIDTHS}; got x {x.shape}, offsets {offsets.shape}, panels {w_panels.shape}")
    offsets = offsets.astype(jnp.int32)
    if x.dtype != jnp.float32 or w_panels.dtype != jnp.float32 or jax.default_backend() != "cpu" or \
            not build.loaded():
        rows = jnp.arange(x.shape[0])
        expert = jnp.searchsorted(offsets, rows, side="right") - 1  # E for the rows past the last expert
        w = w_panels.transpose(0, 2, 1, 3).reshape(E, K, P * W).astype(x.dtype)
        every = jnp.einsum("mk,ekn->emn", x, w)
        return jnp.sum(jnp.where((jnp.arange(E)[:, None] == expert[None])[..., None], every, 0), axis=0)
    build.trace("linear grouped float32")
    return jax.ffi.ffi_call(build.GROUPED_TARGET[0], jax.ShapeDtypeStruct((x.shape[0], P * W), jnp.float32))(
        x, offsets, w_panels)
