"""Quantized linear weights: quantized as they load (``quantization="int8" | "w8a8" | "fp8"``), or read
already quantized from a checkpoint whose ``config.json`` has a ``quantization_config``.

Either way each linear becomes a :class:`~paged_jax.models.weights.QuantizedLinear` and model
code does not change. Checkpoint formats (``quant_method``):

- ``compressed-tensors`` (what llm-compressor writes), one scheme per config group:
  ``pack-quantized`` (int4 / int8 weights packed into int32, scales per group or channel,
  symmetric or with packed zero points, ``g_idx`` when the checkpoint has one),
  ``int-quantized`` (int8 weights per channel, activations int8 per token at run time: W8A8)
  ``float-quantized`` (fp8 weights per tensor, channel or block; activations fp8 per
  token at run time, or none) and ``naive-quantized`` (int8 or fp8 weights stored unpacked).

- ``gptq``, ``awq`` and vLLM's own ``fp8``: :mod:`paged_jax.models.quantization_gptq`.

Everything else (other methods, bit widths, strategies, static activation scales) is refused
when the config is read, before any weight is, naming what is supported.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.models.weights import FP8_MAX, DenseLinear, QuantizedLinear

QUANTIZE_ON_LOAD = ("int8", "w8a8", "fp8")
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
CT_STRATEGIES = ("tensor", "channel", "group", "block")


# --- quantization on load ----------------------------------------------------------------------

def quantize_weight(p: DenseLinear, method: str) -> QuantizedLinear:
    """Per output channel, symmetric: int8 ``scale = max |w| / 127``, ``values = round(w / scale)``;
    fp8 ``scale = max |w| / 448``, ``values = fp8(w / scale)``. ``"w8a8"``: the int8 weight, with
    the activations quantized to int8 per token at run time (compressed-tensors' W8A8 scheme: an
    int8 x int8 matmul, which VNNI runs at 4x the float32 multiply-adds on a CPU)."""
    import jax.numpy as jnp

    w = p.w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
    if method in ("int8", "w8a8"):
        scale = jnp.where(amax == 0, 1.0, amax / 127.0)  # an all-zero column: any scale, its values are 0
        values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    elif method == "fp8":
        scale = jnp.where(amax == 0, 1.0, amax / FP8_MAX)
        values = jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    else:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZE_ON_LOAD)}, got {method!r}")
    return QuantizedLinear(values, scale, b=p.b, bits=8, in_features_=w.shape[0], parallel=p.parallel,
                           act="int8" if method == "w8a8" else None)


def quantize_layers(params: dict, method: str) -> dict:
    """Quantize on load: every float linear weight of every layer (``params["layers"]``), in place
    and one weight at a time, so each float weight can go as its quantized copy comes; the
    embeddings and the LM head stay as they are (as vLLM's on-load quantization leaves them)."""
    if method not in QUANTIZE_ON_LOAD:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZE_ON_LOAD)}, got {method!r}")
    for lp in params["layers"]:
        for key, value in lp.items():
            if isinstance(value, DenseLinear):
                lp[key] = quantize_weight(value, method)
    return params


# --- checkpoints: compressed-tensors -------------------------------------------------------------

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


def _refuse(where: str, what: str, allowed) -> None:
    raise ModelLoadError(f"{where}: quantization_config {what} is not supported; supported: {allowed}")


def _scheme_from_group(group: dict, default_format: Optional[str], where: str) -> WeightScheme:
    fmt = group.get("format") or default_format
    if fmt not in CT_FORMATS:
        _refuse(where, f"format {fmt!r}", list(CT_FORMATS))
    w = group.get("weights")
    if not w:
        _refuse(where, "group without weight quantization", "groups that quantize weights")
    bits, typ, strategy = int(w.get("num_bits", 0)), w.get("type"), w.get("strategy")
    if strategy not in CT_STRATEGIES:
        _refuse(where, f"weight strategy {strategy!r}", list(CT_STRATEGIES))
    if w.get("dynamic"):
        _refuse(where, "dynamic weight quantization", "static weights")
    if (typ, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        _refuse(where, f"{bits}-bit {typ} weights", ["int4", "int8", "fp8 (float, 8 bits)"])
    if fmt == "pack-quantized" and typ != "int":
        _refuse(where, "pack-quantized float weights", "int weights")
    if (fmt == "float-quantized" and typ != "float" or fmt == "int-quantized" and (typ, bits) != ("int", 8)
            or fmt == "naive-quantized" and bits != 8):
        _refuse(where, f"format {fmt!r} with {bits}-bit {typ} weights",
                "int-quantized int8, float-quantized fp8, naive-quantized int8 or fp8")
    if strategy == "group" and not w.get("group_size"):
        _refuse(where, "group strategy without a group_size", "a positive group_size")
    if w.get("actorder") not in (None, "static", "group", "weight"):
        _refuse(where, f"actorder {w.get('actorder')!r}", ["static", "group", "weight"])
    act = group.get("input_activations")
    act_kind = None
    if act:
        a_bits, a_type = int(act.get("num_bits", 0)), act.get("type")
        if not act.get("dynamic") or act.get("strategy") != "token" or not act.get("symmetric", True):
            _refuse(where, f"input activations {act.get('strategy')!r} (dynamic={act.get('dynamic')})",
                    "dynamic symmetric per-token activations, or none")
        if (a_type, a_bits) == ("int", 8):
            act_kind = "int8"
        elif (a_type, a_bits) == ("float", 8):
            act_kind = "fp8"
        else:
            _refuse(where, f"{a_bits}-bit {a_type} activations", ["int8", "fp8"])
    if group.get("output_activations"):
        _refuse(where, "output activation quantization", "none")
    block = tuple(w["block_structure"]) if strategy == "block" else None
    return WeightScheme(targets=tuple(group.get("targets") or ("Linear",)), format=fmt, bits=bits, type=typ,
                        strategy=strategy, group_size=w.get("group_size"), block=block,
                        symmetric=bool(w.get("symmetric", True)), act=act_kind)


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization: its config groups and the modules it leaves float (``ignore``)."""
    schemes: tuple
    ignore: tuple

    @classmethod
    def from_hf(cls, cfg: dict, where: str):
        """The checkpoint's quantization (this class for compressed-tensors, or one of
        :mod:`paged_jax.models.quantization_gptq`), None for a float checkpoint; refuses what is
        not supported before any weight is read. Each answers ``stores_quantized(module, files)``,
        ``scheme_for``, ``tensor_shapes`` and ``linear`` for the loader."""
        qc = cfg.get("quantization_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method not in CHECKPOINT_METHODS:
            _refuse(where, f"quant_method {method!r}", list(CHECKPOINT_METHODS))
        if method != "compressed-tensors":
            from paged_jax.models import quantization_gptq as other

            reader = {"gptq": other.GPTQQuantization, "awq": other.AWQQuantization, "fp8": other.FP8Quantization}
            return reader[method].from_config(qc, where)
        if qc.get("kv_cache_scheme"):
            _refuse(where, "kv_cache_scheme", "none (a quantized KV cache is not read from checkpoints yet)")
        if qc.get("sparsity_config"):
            _refuse(where, "sparsity_config", "none")
        groups = qc.get("config_groups") or {}
        if not groups:
            _refuse(where, "without config_groups", "one or more config groups")
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
            values = _pack_nibbles(values)
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


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """int4 values ``[in, out]`` -> uint8 ``[ceil(in / 2), out]`` (QuantizedLinear's layout)."""
    u = (values.astype(np.int16) + 8).astype(np.uint8)
    if u.shape[0] % 2:
        u = np.concatenate([u, np.full((1, u.shape[1]), 8, np.uint8)])
    return u[0::2] | (u[1::2] << 4)


__all__ = ["QUANTIZE_ON_LOAD", "CHECKPOINT_METHODS", "quantize_weight", "quantize_layers", "CheckpointQuantization",
           "WeightScheme"]
