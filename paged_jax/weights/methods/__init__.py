"""Weight formats by name: the readers of quantized checkpoints (``quant_method`` in a
``config.json``'s ``quantization_config``) and the quantization done on load.

A checkpoint reader is a class with ``from_config(quantization_config, where)`` (refusing, with
:func:`~paged_jax.weights.methods.common.refuse`, what it does not support, before any weight is
read) and, for the loader (:func:`paged_jax.models.loader.load_model`):

- ``stores_quantized(module, files)``: whether linear ``module`` is stored quantized (else float);
- ``scheme_for(module)``: its scheme, or None when no scheme targets it;
- ``tensor_shapes(module, out, inp, available)``: the tensors it reads and their shapes;
- ``linear(module, tensors, out, inp, bias, parallel)``: the weight object.

A new format is one file here and one line in :data:`CHECKPOINT_METHODS`.
"""

from __future__ import annotations

from typing import Optional

from paged_jax.weights.methods.awq import AWQQuantization
from paged_jax.weights.methods.common import refuse
from paged_jax.weights.methods.compressed_tensors import CompressedTensorsQuantization
from paged_jax.weights.methods.fp8 import FP8Quantization
from paged_jax.weights.methods.gptq import GPTQQuantization
from paged_jax.weights.methods.on_load import QUANTIZE_ON_LOAD, quantize_layers, quantize_weight

CHECKPOINT_METHODS = {
    "compressed-tensors": CompressedTensorsQuantization,
    "gptq": GPTQQuantization,
    "awq": AWQQuantization,
    "fp8": FP8Quantization,
}


def checkpoint_quantization(cfg: dict, where: str) -> Optional[object]:
    """The reader for a checkpoint's ``config.json`` (``cfg``), or None for a float checkpoint;
    refuses an unknown method, or what its reader does not support, before any weight is read."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        refuse(where, f"quant_method {method!r}", list(CHECKPOINT_METHODS))
    return CHECKPOINT_METHODS[method].from_config(qc, where)


__all__ = ["CHECKPOINT_METHODS", "QUANTIZE_ON_LOAD", "checkpoint_quantization", "quantize_layers", "quantize_weight"]
