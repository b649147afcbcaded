"""What the checkpoint readers share: the refusal message, and the unsigned packed integers of
GPTQ and AWQ (:func:`unpack_words`, :func:`unsigned_linear`).

Unsigned values and zeros ``[0, 2^bits)`` are centred by ``2^(bits-1)`` into QuantizedLinear's
signed int8 (and 4-bit values packed two per byte); ``(q - c) - (z - c)`` is ``q - z``.
"""

from __future__ import annotations

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.weights.quantized import QuantizedLinear, pack_nibbles


def refuse(where: str, what: str, allowed) -> None:
    raise ModelLoadError(f"{where}: quantization_config {what} is not supported; supported: {allowed}")


def unpack_words(words, bits: int) -> np.ndarray:
    """int32 words ``[..., n]`` -> unsigned ``bits``-wide values ``[..., n * 32 / bits]`` (uint8),
    element ``i`` of each word at bits ``[i * bits, (i + 1) * bits)``."""
    u = np.asarray(words).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    vals = (u[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(*u.shape[:-1], -1).astype(np.uint8)


def centred(q: np.ndarray, bits: int) -> np.ndarray:
    return (q.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def checked_group_size(group, method: str, where: str) -> int:
    """A GPTQ / AWQ ``group_size`` checked: positive, or -1 for one group over the whole input."""
    if not isinstance(group, int) or not (group == -1 or group > 0):
        refuse(where, f"{method} group_size {group!r}", "a positive group_size, or -1 (one group)")
    return group


class OneScheme:
    """These configs have no per-module groups: every quantized module has the one scheme."""

    def scheme_for(self, module: str):
        return self


class PackedInt(OneScheme):
    """GPTQ and AWQ: a module is stored quantized when its packed ``qweight`` is in the checkpoint."""

    def stores_quantized(self, module: str, files) -> bool:
        return module + ".qweight" in files


def group_layout(group_size: int, inp: int) -> tuple:
    """(rows per group, number of groups); a group size of -1 is one group over the whole input."""
    group = inp if group_size == -1 else group_size
    return group, -(-inp // group)


def unsigned_linear(q, zero, scale, g_idx, bits: int, group: int, bias, parallel) -> QuantizedLinear:
    """A QuantizedLinear from unsigned values ``q [in, out]``, unsigned zeros and float scales
    ``[groups, out]`` and an optional ``g_idx``. Zeros that are all the midpoint (symmetric) and a
    ``g_idx`` that only says "contiguous groups" are dropped: the same weight, and the forms the
    native CPU matmul takes."""
    import jax.numpy as jnp

    n_in = q.shape[0]
    values = centred(q, bits)
    if bits == 4:
        values = pack_nibbles(values)
    zero = centred(zero, bits)
    if not zero.any():
        zero = None
    if g_idx is not None:
        g_idx = np.asarray(g_idx, dtype=np.int32)
        if np.array_equal(g_idx, np.arange(n_in) // group):
            g_idx = None
    return QuantizedLinear(jnp.asarray(values), jnp.asarray(np.asarray(scale, dtype=np.float32)),
                           zero=None if zero is None else jnp.asarray(zero),
                           g_idx=None if g_idx is None else jnp.asarray(g_idx),
                           b=bias, bits=bits, in_features_=n_in, block=(group, 1), parallel=parallel)
