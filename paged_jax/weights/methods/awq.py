"""AWQ checkpoints into :class:`~paged_jax.weights.quantized.QuantizedLinear` weights.

``awq`` (AutoAWQ, GPTQModel; ``version: gemm``): ``qweight`` int32 ``[in, out / 8]`` packed
along the output, ``qzeros`` int32 ``[groups, out / 8]`` alike, ``scales`` ``[groups, out]``;
word ``k`` holds columns ``8k + [0, 2, 4, 6, 1, 3, 5, 7]`` in nibbles 0..7. ``w = (q - z) * s``.
The zeros are read whatever ``zero_point`` says, as vLLM reads them: with ``zero_point: false``
GPTQModel writes them all 8, the midpoint.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.weights.methods.common import PackedInt, checked_group_size, group_layout, refuse, unpack_words, unsigned_linear
from paged_jax.weights.quantized import QuantizedLinear

AWQ_VERSIONS = ("gemm",)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8


def _awq_columns(packed) -> np.ndarray:
    """AWQ words ``[rows, out / 8]`` -> 4-bit values ``[rows, out]`` in column order."""
    vals = unpack_words(packed, 4)
    natural = np.empty_like(vals)
    for nibble, col in enumerate(AWQ_ORDER):
        natural[:, col::8] = vals[:, nibble::8]
    return natural


@dataclasses.dataclass(frozen=True)
class AWQQuantization(PackedInt):
    group_size: int

    bits = 4

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "AWQQuantization":
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            refuse(where, f"awq with bits={bits!r}", ["bits 4"])
        version = str(qc.get("version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            refuse(where, f"awq version {version!r}", list(AWQ_VERSIONS))
        group = checked_group_size(qc.get("group_size", qc.get("q_group_size", -1)), "awq", where)
        return cls(group_size=group)

    def tensor_shapes(self, module: str, out: int, inp: int, available) -> dict:
        _, groups = group_layout(self.group_size, inp)
        p = module + "."
        return {p + "qweight": (inp, -(-out // 8)), p + "qzeros": (groups, -(-out // 8)), p + "scales": (groups, out)}

    def linear(self, module: str, tensors: dict, out: int, inp: int, bias, parallel) -> QuantizedLinear:
        p = module + "."
        q = _awq_columns(tensors[p + "qweight"])[:, :out]
        zero = _awq_columns(tensors[p + "qzeros"])[:, :out]
        group, _ = group_layout(self.group_size, inp)
        return unsigned_linear(q, zero, tensors[p + "scales"], None, 4, group, bias, parallel)
