"""GPTQ checkpoints into :class:`~paged_jax.weights.quantized.QuantizedLinear` weights.

``gptq`` (GPTQModel, AutoGPTQ): ``qweight`` int32 ``[in * bits / 32, out]``, ``bits``-wide
unsigned values packed along the input, element ``i`` of a word at bits ``[i * bits, (i + 1) *
bits)``; ``qzeros`` int32 ``[groups, out * bits / 32]`` packed the same way along the output;
``scales`` float ``[groups, out]``; ``g_idx`` int32 ``[in]``, each input row's group (activation
order, ``desc_act``). ``w = (q - z) * s``. ``checkpoint_format: gptq`` (v1) stores every zero
minus one, subtracted from the packed word as a whole (``0x11111111`` for 4 bits), so it is
added back to the word (a zero of 0 borrowed from its neighbour and is restored exactly);
``gptq_v2`` stores the zeros as they are.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.weights.methods.common import PackedInt, checked_group_size, group_layout, refuse, unpack_words, unsigned_linear
from paged_jax.weights.quantized import QuantizedLinear

GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclasses.dataclass(frozen=True)
class GPTQQuantization(PackedInt):
    bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool
    v1_zeros: bool  # checkpoint_format "gptq": zeros stored minus one

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "GPTQQuantization":
        bits = qc.get("bits")
        if bits not in GPTQ_BITS:
            refuse(where, f"gptq with bits={bits!r}", [f"bits {b}" for b in GPTQ_BITS])
        group = checked_group_size(qc.get("group_size", -1), "gptq", where)
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in GPTQ_FORMATS:
            refuse(where, f"gptq checkpoint_format {fmt!r}", list(GPTQ_FORMATS))
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            refuse(where, f"gptq pack_dtype {qc.get('pack_dtype')!r}", ["int32"])
        if qc.get("dynamic"):
            refuse(where, "gptq per-module overrides ('dynamic')", "one bit width and group size for all modules")
        return cls(bits=bits, group_size=group, desc_act=bool(qc.get("desc_act")), v1_zeros=fmt == "gptq")

    def tensor_shapes(self, module: str, out: int, inp: int, available) -> dict:
        pack = 32 // self.bits
        _, groups = group_layout(self.group_size, inp)
        p = module + "."
        shapes = {p + "qweight": (-(-inp // pack), out), p + "qzeros": (groups, -(-out // pack)),
                  p + "scales": (groups, out)}
        if self.desc_act or p + "g_idx" in available:
            shapes[p + "g_idx"] = (inp,)
        return shapes

    def linear(self, module: str, tensors: dict, out: int, inp: int, bias, parallel) -> QuantizedLinear:
        p = module + "."
        q = unpack_words(np.ascontiguousarray(tensors[p + "qweight"].T), self.bits).T[:inp]  # [in, out]
        qzeros = np.asarray(tensors[p + "qzeros"]).view(np.uint32)
        if self.v1_zeros:  # undo the writer's word-wide "minus one" (uint32 arithmetic wraps as it did)
            qzeros = qzeros + np.uint32(0x11111111 if self.bits == 4 else 0x01010101)
        zero = unpack_words(qzeros, self.bits)[:, :out]
        group, _ = group_layout(self.group_size, inp)
        return unsigned_linear(q, zero, tensors[p + "scales"], tensors.get(p + "g_idx"), self.bits, group,
                                 bias, parallel)
