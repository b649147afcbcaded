"""Loading a model for the engine: read it (a Hugging Face folder or a paged-jax orbax checkpoint,
on one device or straight into its tensor-parallel shards), then ready its weights for the
platform in one step (:func:`paged_jax.weights.prepare`: quantization on load, the native CPU
matmuls' panels). The runner takes the weights as they come from here."""

from __future__ import annotations

import dataclasses
from typing import Optional


def load_for_serving(path, dtype: str = "auto", tensor_parallel_size: int = 1, quantization: Optional[str] = None,
                     native_kernels: bool = True):
    """(ModelConfig, params, mesh or None) for a HF folder or a paged-jax orbax checkpoint.

    ``tensor_parallel_size == 1`` on a HF folder is the plain single-device loader. A quantized
    checkpoint loads whole on the host and is then placed by the sharding rules.
    ``quantization`` (:data:`paged_jax.weights.QUANTIZE_ON_LOAD`) and ``native_kernels``: see
    :func:`paged_jax.weights.prepare`.
    """
    import jax

    from paged_jax.models.loader import load_model, read_config
    from paged_jax.parallel import check_tensor_parallel, checkpoint, make_mesh
    from paged_jax.weights.prepare import native_kernels_apply, prepare

    tp = tensor_parallel_size
    if tp == 1 and not checkpoint.is_orbax_checkpoint(path):
        config, params = load_model(path, dtype)
        mesh = None
    elif not checkpoint.is_orbax_checkpoint(path) and read_config(path).get("quantization_config"):
        from paged_jax.parallel.rules import param_shardings

        config, rep = check_tensor_parallel(checkpoint.load_config_any(path, dtype), tp)
        if rep > 1:
            raise ValueError(f"tensor_parallel_size={tp} would replicate the KV heads, which a quantized checkpoint "
                             f"does not support yet; use a tp that divides the model's KV heads")
        mesh = make_mesh(tp)
        _, params = load_model(path, dtype)
        params = jax.device_put(params, param_shardings(params, mesh))
    else:
        model_config = checkpoint.load_config_any(path, dtype)
        config, rep = check_tensor_parallel(model_config, tp)  # before any weight is read
        mesh = make_mesh(tp)
        params = checkpoint.load_sharded(path, model_config, mesh, kv_replication=rep)
    platform, tensor_parallel = jax.default_backend(), mesh is not None
    params = prepare(params, platform, quantization=quantization, tensor_parallel=tensor_parallel,
                     native_kernels=native_kernels)
    # The RMS norms in one native operation each where the matmuls got the native kernels (one
    # device: under tensor parallelism XLA would gather sharded hidden states for a call it cannot split)
    native_norm = native_kernels_apply(platform, tensor_parallel=tensor_parallel, native_kernels=native_kernels)
    return dataclasses.replace(config, native_norm=native_norm), params, mesh
