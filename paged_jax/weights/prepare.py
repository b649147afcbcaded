"""The one step that turns loaded weights into the weights the engine runs."""

from __future__ import annotations

import logging
from typing import Optional

from paged_jax import native
from paged_jax.weights.methods.on_load import INT4_GROUPS, quantize_layers
from paged_jax.weights.fused import fuse_inputs
from paged_jax.weights.panels import to_panels

logger = logging.getLogger("paged_jax")


def native_kernels_apply(platform: str, *, tensor_parallel: bool = False, native_kernels: bool = True) -> bool:
    """Whether a model loaded for ``platform`` runs the native CPU kernels: a CPU, one device
    (``tensor_parallel`` False), ``native_kernels`` on and the library built. :func:`prepare` packs
    weights for them then, and the loader sets the config's ``native_norm`` by the same answer."""
    return platform == "cpu" and not tensor_parallel and native_kernels and native.available()


def prepare(params, platform: str, *, quantization: Optional[str] = None, tensor_parallel: bool = False,
            native_kernels: bool = True):
    """``params`` as the engine runs them on ``platform`` (JAX's: ``"cpu"``, ``"gpu"``, ...):

    1. ``quantization`` (:data:`~paged_jax.weights.methods.QUANTIZE_ON_LOAD`): the layers' float
       linear weights quantized as they load (sharded ones keep their shards);
    2. on a CPU, with one device (``tensor_parallel`` False) and ``native_kernels`` where the
       native library builds: the weights its matmuls take stored as panels
       (:func:`~paged_jax.weights.panels.to_panels`): quantized ones always, float32 ones where the
       float matmul has AVX-512 tiles, or AVX2 tiles on a CPU without AVX-512
       (:func:`~paged_jax.native.packs_weights`: its portable loops lose to XLA's matmul); ``"int4"`` /
       ``"int4-g128"`` weights to the int4 x int8 kernel, as llama.cpp multiplies q4_0 (the
       activations quantized to int8 per block of 32, :func:`paged_jax.native.linear_int4`);
    3. there, each layer's Q, K and V panels, and its gate and up ones, stored as one weight
       (:func:`~paged_jax.weights.fused.fuse_inputs`): one kernel call where there were two or three.

    Called once, where the engine loads the model: nothing after it repacks."""
    if quantization is not None:
        params = quantize_layers(params, quantization)
    if native_kernels_apply(platform, tensor_parallel=tensor_parallel, native_kernels=native_kernels):
        floats = native.packs_weights()
        # 4 bits on load is llama.cpp's q4_0, multiplied as it multiplies it (q8_0 activations, integer dot products)
        params = to_panels(params, floats=floats, int4_int8=quantization in INT4_GROUPS)
        params = fuse_inputs(params)  # Q, K, V and gate, up: one call each (bitwise the same outputs)
        logger.info("weights stored for the native CPU matmuls (%s)", "float32 and quantized" if floats else
                    "quantized only: XLA's float32 matmul is the faster on this CPU and build")
        limits = native.status()["quantized_native_rows"]
        if quantization is not None and any(v is not None for v in limits.values()):
            logger.info("quantized matmuls: the native kernel for steps of up to so many rows (%s), XLA's "
                        "dequantize-then-matmul above (faster there on this CPU and build)",
                        ", ".join(f"{k}: {v or 'all'}" for k, v in limits.items()))
        if quantization is not None and native.paths()["linear quantized"] == "portable":
            # every quantized format measured slower than float32 there (experiments/bench_matmul_isa.py)
            logger.warning("quantization=%r: this CPU's native build has neither AVX-512 nor AVX2 tiles, and the "
                           "quantized matmuls' portable loops run slower than float32 weights (they still take "
                           "less memory); load without quantization for speed", quantization)
    return params
