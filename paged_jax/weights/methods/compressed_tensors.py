"""compressed-tensors checkpoints (what llm-compressor writes) into
:class:`~paged_jax.weights.quantized.QuantizedLinear` weights, one scheme per config group:

- ``pack-quantized``: int4 / int8 weights packed into int32, scales per group or channel,
  symmetric or with packed zero points, ``g_idx`` when the checkpoint has one;
- ``int-quantized``: int8 weights per channel, activations int8 per token at run time (W8A8);
- ``float-quantized``: fp8 weights per tensor, channel or block; activations fp8 per token at
  run time, or none;
- ``naive-quantized``: int8 or fp8 weights stored unpacked.

Other bit widths, strategies and static activation scales are refused when the config is read,
before any weight is, naming what is supported.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.weights.methods.common import refuse
from paged_jax.weights.quantized import QuantizedLinear, pack_nibbles

CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
CT_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """One compressed-tensors config group: which modules, and how their weights are stored."""
    targets: tuple
    format: str
    bits: int
    type: str  # "int" | "float"
    strategy: str
    group_size: Optional[int]
    block: Optional[tuple]  # (rows of out, rows of in)
    symmetric: bool
    act: Optional[str]  # None | "int8" | "fp8": activations quantized per token at run time

    def block_of_scale(self, out: int, inp: int) -> tuple:
        """(rows of the input, columns of the output) one scale covers, in paged-jax's ``[in, out]``."""
        if self.strategy == "tensor":
            return (inp, out)
        if self.strategy == "channel":
            return (inp, 1)
        if self.strategy == "group":
            return (self.group_size, 1)
        return (self.block[1], self.block[0])

    def scale_shape(self, out: int, inp: int) -> tuple:
        """The checkpoint's ``weight_scale`` shape (HF layout, ``[out, ...]``)."""
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (out, 1)
        if self.strategy == "group":
            return (out, -(-inp // self.group_size))
        return (-(-out // self.block[0]), -(-inp // self.block[1]))


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern)


def _scheme_from_group(group: dict, default_format: Optional[str], where: str) -> WeightScheme:
    fmt = group.get("format") or default_format
    if fmt not in CT_FORMATS:
        refuse(where, f"format {fmt!r}", list(CT_FORMATS))
    w = group.get("weights")
    if not w:
        refuse(where, "group without weight quantization", "groups that quantize weights")
    bits, typ, strategy = int(w.get("num_bits", 0)), w.get("type"), w.get("strategy")
    if strategy not in CT_STRATEGIES:
        refuse(where, f"weight strategy {strategy!r}", list(CT_STRATEGIES))
    if w.get("dynamic"):
        refuse(where, "dynamic weight quantization", "static weights")
    if (typ, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        refuse(where, f"{bits}-bit {typ} weights", ["int4", "int8", "fp8 (float, 8 bits)"])
    if fmt == "pack-quantized" and typ != "int":
        refuse(where, "pack-quantized float weights", "int weights")
    if (fmt == "float-quantized" and typ != "float" or fmt == "int-quantized" and (typ, bits) != ("int", 8)
            or fmt == "naive-quantized" and bits != 8):
        refuse(where, f"format {fmt!r} with {bits}-bit {typ} weights",
                "int-quantized int8, float-quantized fp8, naive-quantized int8 or fp8")
    if strategy == "group" and not w.get("group_size"):
        refuse(where, "group strategy without a group_size", "a positive group_size")
    if w.get("actorder") not in (None, "static", "group", "weight"):
        refuse(where, f"actorder {w.get('actorder')!r}", ["static", "group", "weight"])
    act = group.get("input_activations")
    act_kind = None
    if act:
        a_bits, a_type = int(act.get("num_bits", 0)), act.get("type")
        if not act.get("dynamic") or act.get("strategy") != "token" or not act.get("symmetric", True):
            refuse(where, f"input activations {act.get('strategy')!r} (dynamic={act.get('dynamic')})",
                    "dynamic symmetric per-token activations, or none")
        if (a_type, a_bits) == ("int", 8):
            act_kind = "int8"
        elif (a_type, a_bits) == ("float", 8):
            act_kind = "fp8"
        else:
            refuse(where, f"{a_bits}-bit {a_type} activations", ["int8", "fp8"])
    if group.get("output_activations"):
        refuse(where, "output activation quantization", "none")
    block = tuple(w["block_structure"]) if strategy == "block" else None
    return WeightScheme(targets=tuple(group.get("targets") or ("Linear",)), format=fmt, bits=bits, type=typ,
                        strategy=strategy, group_size=w.get("group_size"), block=block,
                        symmetric=bool(w.get("symmetric", True)), act=act_kind)


@dataclasses.dataclass(frozen=True)
class CompressedTensorsQuantization:
    """A checkpoint's quantization: its config groups and the modules it leaves float (``ignore``)."""
    schemes: tuple
    ignore: tuple

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "CompressedTensorsQuantization":
        """The checkpoint's schemes; refuses what is not supported before any weight is read."""
        if qc.get("kv_cache_scheme"):
            refuse(where, "kv_cache_scheme", "none (a quantized KV cache is not read from checkpoints yet)")
        if qc.get("sparsity_config"):
            refuse(where, "sparsity_config", "none")
        groups = qc.get("config_groups") or {}
        if not groups:
            refuse(where, "without config_groups", "one or more config groups")
        schemes = tuple(_scheme_from_group(g, qc.get("format"), where) for g in groups.values())
        return cls(schemes, tuple(qc.get("ignore") or ()))

    def stores_quantized(self, module: str, files) -> bool:
        return module + ".weight_scale" in files

    def scheme_for(self, module: str) -> Optional[WeightScheme]:
        """The scheme that quantizes linear ``module`` (e.g. ``model.layers.0.mlp.up_proj``), or None."""
        if any(_matches(p, module) and p != "Linear" for p in self.ignore):
            return None
        for s in self.schemes:
            if any(_matches(t, module) for t in s.targets):
                return s
        return None

    def tensor_shapes(self, module: str, out: int, inp: int, available) -> dict:
        """The tensors of a quantized linear ``module`` and their shapes (``weight_g_idx`` only
        where the checkpoint has it)."""
        s = self.scheme_for(module)
        p = module + "."
        scale = s.scale_shape(out, inp)
        if s.format == "pack-quantized":
            shapes = {p + "weight_packed": (out, -(-inp * s.bits // 32)), p + "weight_scale": scale,
                      p + "weight_shape": (2,)}
            if not s.symmetric:
                shapes[p + "weight_zero_point"] = (-(-out * s.bits // 32), scale[1])
        else:
            shapes = {p + "weight": (out, inp), p + "weight_scale": scale}
            if not s.symmetric:
                shapes[p + "weight_zero_point"] = scale
        if p + "weight_g_idx" in available:
            shapes[p + "weight_g_idx"] = (inp,)
        return shapes

    def linear(self, module: str, tensors: dict, out: int, inp: int, bias, parallel) -> QuantizedLinear:
        """A :class:`QuantizedLinear` from ``module``'s checkpoint tensors (HF layout ``[out, in]``)."""
        import jax.numpy as jnp

        s = self.scheme_for(module)
        p = module + "."
        scale = np.asarray(tensors[p + "weight_scale"], dtype=np.float32).reshape(s.scale_shape(out, inp)).T
        if s.strategy == "tensor":
            scale = scale.reshape(1, 1)
        zero = None
        if s.format == "pack-quantized":
            if tuple(int(d) for d in np.asarray(tensors[p + "weight_shape"])) != (out, inp):
                raise ModelLoadError(f"{module}.weight_shape is {np.asarray(tensors[p + 'weight_shape']).tolist()}, "
                                     f"the config implies {[out, inp]}")
            values = _unpack_int32(tensors[p + "weight_packed"], s.bits, inp)  # [out, in] in [-2^(b-1), 2^(b-1))
            if not s.symmetric:
                # packed along out: [ceil(out * bits / 32), G] -> [G, out]
                zero = _unpack_int32(np.ascontiguousarray(tensors[p + "weight_zero_point"].T), s.bits, out)
        else:
            values = tensors[p + "weight"]
            if not s.symmetric:
                zero = np.asarray(tensors[p + "weight_zero_point"]).reshape(s.scale_shape(out, inp)).T
        values = np.ascontiguousarray(values.T)  # [in, out]
        if s.bits == 4:
            values = pack_nibbles(values)
        elif s.type == "float":
            values = values.astype(jnp.float8_e4m3fn) if values.dtype != jnp.float8_e4m3fn else values
        else:
            values = values.astype(np.int8)
        g_idx = tensors.get(p + "weight_g_idx")
        return QuantizedLinear(
            jnp.asarray(values), jnp.asarray(scale),
            zero=None if zero is None else jnp.asarray(np.asarray(zero, dtype=np.int8)),
            g_idx=None if g_idx is None else jnp.asarray(np.asarray(g_idx, dtype=np.int32)),
            b=bias, bits=s.bits, in_features_=inp, block=s.block_of_scale(out, inp), act=s.act,
            parallel=parallel)


def _unpack_int32(packed, bits: int, n: int) -> np.ndarray:
    """compressed-tensors' int32 packing along the last axis (element ``i`` at bits
    ``[i * bits, (i + 1) * bits)``, little-endian, stored plus ``2^(bits-1)``) -> int8 ``[..., n]``."""
    raw = np.ascontiguousarray(np.asarray(packed, dtype="<i4")).view(np.uint8)
    if bits == 4:
        raw = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(*raw.shape[:-1], -1)
    return (raw[..., :n].astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
