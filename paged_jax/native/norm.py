"""The RMS norm in one native operation (``rms_norm.cc``) through the XLA FFI, where XLA's CPU
backend spends four (see the C++ file's comment)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.native import build

if TYPE_CHECKING:
    import jax


def rms_norm_applies(x, w) -> bool:
    """Whether :func:`rms_norm` takes these operands: float32 ``x [..., D]`` and ``w [D]`` on a CPU,
    the kernels registered (:func:`~paged_jax.native.build.loaded`)."""
    import jax
    import jax.numpy as jnp

    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 1 and x.ndim >= 1
            and x.shape[-1] == w.shape[0] and jax.default_backend() == "cpu" and build.loaded())


def rms_norm(x, w, eps: float) -> "jax.Array":
    """``w * (x * rsqrt(mean(x ** 2, -1) + eps))`` over the last axis of float32 ``x`` (any leading
    shape), in one call; only where :func:`rms_norm_applies`."""
    import jax
    import jax.numpy as jnp

    if not rms_norm_applies(x, w):
        raise ValueError(f"rms_norm takes float32 x [..., D] and w [D] on a CPU with the kernels loaded; "
                         f"got x {x.dtype} {x.shape}, w {w.dtype} {w.shape}")
    build.trace("rms norm float32")
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    call = jax.ffi.ffi_call(build.RMS_NORM_TARGET[0], jax.ShapeDtypeStruct(x2.shape, jnp.float32))
    y = call(x2, w, eps=np.float32(eps))
    return y.reshape(x.shape)
