"""vLLM's own fp8 checkpoints into :class:`~paged_jax.weights.quantized.QuantizedLinear` weights.

``fp8`` (vLLM's own): ``weight`` float8 e4m3 ``[out, in]`` with ``weight_scale`` (one per
tensor) or, with ``weight_block_size: [bo, bi]``, ``weight_scale_inv`` ``[ceil(out / bo),
ceil(in / bi)]`` (despite its name a multiplier, as DeepSeek-V3 stores it). ``w = fp8 * s``.
Activations stay float (``activation_scheme: dynamic``): the weight-only path vLLM takes on a GPU
without fp8 matmuls and transformers takes on a CPU; static input scales are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.weights.methods.common import OneScheme, refuse
from paged_jax.weights.quantized import QuantizedLinear

FP8_FORMATS = ("e4m3", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class FP8Quantization(OneScheme):
    block: Optional[tuple]  # (rows of out, columns of in) per scale; None: one scale per tensor

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "FP8Quantization":
        if "weight_scale_semantics" in qc or "weight_scale_method" in qc:
            refuse(where, f"fp8 weight_scale_semantics {qc.get('weight_scale_semantics')!r} (GPTQModel's own fp8, "
                    "whose weights are divided by weight_scale_inv)",
                    "vLLM's fp8, whose weight_scale / weight_scale_inv multiply the weights")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            refuse(where, f"fp8 activation_scheme {scheme!r} (static input scales)", ["dynamic"])
        fmt = qc.get("fmt", "e4m3")
        if fmt not in FP8_FORMATS:
            refuse(where, f"fp8 fmt {fmt!r}", ["e4m3"])
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            refuse(where, f"fp8 weight_block_size {block!r}", "two positive integers, e.g. [128, 128], or none")
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
