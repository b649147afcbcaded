"""Reading GPTQ, AWQ and vLLM-native fp8 checkpoints into :class:`QuantizedLinear` weights.

The three formats as their writers store them (HF module names; a module stored quantized is
one whose marker tensor is in the checkpoint, every other linear stays float):

- ``gptq`` (GPTQModel, AutoGPTQ): ``qweight`` int32 ``[in * bits / 32, out]``, ``bits``-wide
  unsigned values packed along the input, element ``i`` of a word at bits ``[i * bits, (i + 1) *
  bits)``; ``qzeros`` int32 ``[groups, out * bits / 32]`` packed the same way along the output;
  ``scales`` float ``[groups, out]``; ``g_idx`` int32 ``[in]``, each input row's group (activation
  order, ``desc_act``). ``w = (q - z) * s``. ``checkpoint_format: gptq`` (v1) stores every zero
  minus one, subtracted from the packed word as a whole (``0x11111111`` for 4 bits), so it is
  added back to the word (a zero of 0 borrowed from its neighbour and is restored exactly);
  ``gptq_v2`` stores the zeros as they are.
- ``awq`` (AutoAWQ, GPTQModel; ``version: gemm``): ``qweight`` int32 ``[in, out / 8]`` packed
  along the output, ``qzeros`` int32 ``[groups, out / 8]`` alike, ``scales`` ``[groups, out]``;
  word ``k`` holds columns ``8k + [0, 2, 4, 6, 1, 3, 5, 7]`` in nibbles 0..7. ``w = (q - z) * s``.
  The zeros are read whatever ``zero_point`` says, as vLLM reads them: with ``zero_point: false``
  GPTQModel writes them all 8, the midpoint.
- ``fp8`` (vLLM's own): ``weight`` float8 e4m3 ``[out, in]`` with ``weight_scale`` (one per
  tensor) or, with ``weight_block_size: [bo, bi]``, ``weight_scale_inv`` ``[ceil(out / bo),
  ceil(in / bi)]`` (despite its name a multiplier, as DeepSeek-V3 stores it). ``w = fp8 * s``.
  Activations stay float (``activation_scheme: dynamic``): the weight-only path vLLM takes on a GPU
  without fp8 matmuls and transformers takes on a CPU; static input scales are refused.

Unsigned values and zeros ``[0, 2^bits)`` are centred by ``2^(bits-1)`` into QuantizedLinear's
signed int8 (and 4-bit values packed two per byte); ``(q - c) - (z - c)`` is ``q - z``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.models.weights import QuantizedLinear

GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
FP8_FORMATS = ("e4m3", "float8_e4m3fn")


def _refuse(where: str, what: str, allowed) -> None:
    raise ModelLoadError(f"{where}: quantization_config {what} is not supported; supported: {allowed}")


def unpack_words(words, bits: int) -> np.ndarray:
    """int32 words ``[..., n]`` -> unsigned ``bits``-wide values ``[..., n * 32 / bits]`` (uint8),
    element ``i`` of each word at bits ``[i * bits, (i + 1) * bits)``."""
    u = np.asarray(words).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    vals = (u[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(*u.shape[:-1], -1).astype(np.uint8)


def _centred(q: np.ndarray, bits: int) -> np.ndarray:
    return (q.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def _group_size(group, method: str, where: str) -> int:
    """A GPTQ / AWQ ``group_size`` checked: positive, or -1 for one group over the whole input."""
    if not isinstance(group, int) or not (group == -1 or group > 0):
        _refuse(where, f"{method} group_size {group!r}", "a positive group_size, or -1 (one group)")
    return group


class _OneScheme:
    """These configs have no per-module groups: every quantized module has the one scheme."""

    def scheme_for(self, module: str):
        return self


class _PackedInt(_OneScheme):
    """GPTQ and AWQ: a module is stored quantized when its packed ``qweight`` is in the checkpoint."""

    def stores_quantized(self, module: str, files) -> bool:
        return module + ".qweight" in files


def _groups(group_size: int, inp: int) -> tuple:
    """(rows per group, number of groups); a group size of -1 is one group over the whole input."""
    group = inp if group_size == -1 else group_size
    return group, -(-inp // group)


def _quantized_linear(q, zero, scale, g_idx, bits: int, group: int, bias, parallel) -> QuantizedLinear:
    """A QuantizedLinear from unsigned values ``q [in, out]``, unsigned zeros and float scales
    ``[groups, out]`` and an optional ``g_idx``. Zeros that are all the midpoint (symmetric) and a
    ``g_idx`` that only says "contiguous groups" are dropped: the same weight, and the forms the
    native CPU matmul takes."""
    import jax.numpy as jnp

    from paged_jax.models.quantization import _pack_nibbles

    n_in = q.shape[0]
    values = _centred(q, bits)
    if bits == 4:
        values = _pack_nibbles(values)
    zero = _centred(zero, bits)
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


# --- GPTQ -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GPTQQuantization(_PackedInt):
    bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool
    v1_zeros: bool  # checkpoint_format "gptq": zeros stored minus one

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "GPTQQuantization":
        bits = qc.get("bits")
        if bits not in GPTQ_BITS:
            _refuse(where, f"gptq with bits={bits!r}", [f"bits {b}" for b in GPTQ_BITS])
        group = _group_size(qc.get("group_size", -1), "gptq", where)
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in GPTQ_FORMATS:
            _refuse(where, f"gptq checkpoint_format {fmt!r}", list(GPTQ_FORMATS))
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            _refuse(where, f"gptq pack_dtype {qc.get('pack_dtype')!r}", ["int32"])
        if qc.get("dynamic"):
            _refuse(where, "gptq per-module overrides ('dynamic')", "one bit width and group size for all modules")
        return cls(bits=bits, group_size=group, desc_act=bool(qc.get("desc_act")), v1_zeros=fmt == "gptq")

    def tensor_shapes(self, module: str, out: int, inp: int, available) -> dict:
        pack = 32 // self.bits
        _, groups = _groups(self.group_size, inp)
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
        group, _ = _groups(self.group_size, inp)
        return _quantized_linear(q, zero, tensors[p + "scales"], tensors.get(p + "g_idx"), self.bits, group,
                                 bias, parallel)


# --- AWQ --------------------------------------------------------------------------------------

def _awq_columns(packed) -> np.ndarray:
    """AWQ words ``[rows, out / 8]`` -> 4-bit values ``[rows, out]`` in column order."""
    vals = unpack_words(packed, 4)
    natural = np.empty_like(vals)
    for nibble, col in enumerate(AWQ_ORDER):
        natural[:, col::8] = vals[:, nibble::8]
    return natural


@dataclasses.dataclass(frozen=True)
class AWQQuantization(_PackedInt):
    group_size: int

    bits = 4

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "AWQQuantization":
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            _refuse(where, f"awq with bits={bits!r}", ["bits 4"])
        version = str(qc.get("version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            _refuse(where, f"awq version {version!r}", list(AWQ_VERSIONS))
        group = _group_size(qc.get("group_size", qc.get("q_group_size", -1)), "awq", where)
        return cls(group_size=group)

    def tensor_shapes(self, module: str, out: int, inp: int, available) -> dict:
        _, groups = _groups(self.group_size, inp)
        p = module + "."
        return {p + "qweight": (inp, -(-out // 8)), p + "qzeros": (groups, -(-out // 8)), p + "scales": (groups, out)}

    def linear(self, module: str, tensors: dict, out: int, inp: int, bias, parallel) -> QuantizedLinear:
        p = module + "."
        q = _awq_columns(tensors[p + "qweight"])[:, :out]
        zero = _awq_columns(tensors[p + "qzeros"])[:, :out]
        group, _ = _groups(self.group_size, inp)
        return _quantized_linear(q, zero, tensors[p + "scales"], None, 4, group, bias, parallel)


# --- vLLM's fp8 ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FP8Quantization(_OneScheme):
    block: Optional[tuple]  # (rows of out, columns of in) per scale; None: one scale per tensor

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "FP8Quantization":
        if "weight_scale_semantics" in qc or "weight_scale_method" in qc:
            _refuse(where, f"fp8 weight_scale_semantics {qc.get('weight_scale_semantics')!r} (GPTQModel's own fp8, "
                    "whose weights are divided by weight_scale_inv)",
                    "vLLM's fp8, whose weight_scale / weight_scale_inv multiply the weights")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            _refuse(where, f"fp8 activation_scheme {scheme!r} (static input scales)", ["dynamic"])
        fmt = qc.get("fmt", "e4m3")
        if fmt not in FP8_FORMATS:
            _refuse(where, f"fp8 fmt {fmt!r}", ["e4m3"])
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            _refuse(where, f"fp8 weight_block_size {block!r}", "two positive integers, e.g. [128, 128], or none")
        return cls(block=None if block is None else tuple(block))

    @property
    def scale_name(self) -> str:
        return "weight_scale" if self.block is None else "weight_scale_inv"

    def stores_quantized(self, module: str, files) -> bool:
        # either name: a scale of the other kind is then reported missing, not read as a float weight
        return f"{module}.weight_scale" in files or f"{module}.weight_scale_inv" in files

    def tensor_shapes(self, module: str, out: int, inp: int, available) -> dict:
        p = module + "."
        if self.block is None:
            # written as a scalar or as [1] (None: any shape; linear() checks it is one value)
            return {p + "weight": (out, inp), p + "weight_scale": None}
        return {p + "weight": (out, inp),
                p + "weight_scale_inv": (-(-out // self.block[0]), -(-inp // self.block[1]))}

    def linear(self, module: str, tensors: dict, out: int, inp: int, bias, parallel) -> QuantizedLinear:
        import jax.numpy as jnp

        p = module + "."
        weight = tensors[p + "weight"]
        if weight.dtype != jnp.float8_e4m3fn:
            raise ModelLoadError(f"{module}.weight is {weight.dtype}, the fp8 quantization_config implies float8_e4m3fn")
        scale = np.asarray(tensors[p + self.scale_name], dtype=np.float32)
        if self.block is None:
            if scale.size != 1:
                raise ModelLoadError(f"{module}.weight_scale has shape {scale.shape}, one scale per tensor expected")
            scale, block = scale.reshape(1, 1), (inp, out)
        else:
            scale, block = scale.T, (self.block[1], self.block[0])  # HF [out, in] -> ours [in, out]
        return QuantizedLinear(jnp.asarray(np.ascontiguousarray(weight.T)), jnp.asarray(np.ascontiguousarray(scale)),
                               b=bias, bits=8, in_features_=inp, block=block, parallel=parallel)


__all__ = ["GPTQQuantization", "AWQQuantization", "FP8Quantization", "unpack_words", "AWQ_ORDER"]
