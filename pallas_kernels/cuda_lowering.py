"""Lower the Triton kernels for CUDA on a machine without a GPU (tests, ahead-of-time checks).

``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs Pallas' Triton lowering, which
needs a GPU's compute capability. JAX 0.10 falls back to sm90 when no GPU is present; from 0.11
the lowering raises ``RuntimeError: No supported GPU devices found`` unless an abstract GPU device
is in scope (``jax.sharding.use_abstract_mesh``). :func:`cuda_target` provides one (an H100, sm90,
the GPU machine's kind) when the default device is not a GPU, and nothing when it is (the real
device is then the target). ``AbstractDevice``, ``AbstractMesh(..., abstract_device=)`` and
``use_abstract_mesh`` exist in JAX 0.10, 0.11 and 0.12.
"""

from __future__ import annotations

import contextlib

import jax

# Matched by name in JAX's GPU table (H100 -> compute capability 9.0): fp8 conversions need >= 8.9.
DEFAULT_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def cuda_target(device_kind: str = DEFAULT_DEVICE_KIND):
    """Within this block, lowering for ``"cuda"`` targets ``device_kind`` when no GPU is the default device."""
    if jax.default_backend() == "gpu":
        yield
        return
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None,
                                                               platform="gpu"))
    with use_abstract_mesh(mesh):
        yield


def lower_for_cuda(f, *args, **kwargs):
    """``jax.jit(f)`` traced on ``args`` and lowered for CUDA (see :func:`cuda_target`); returns the Lowered."""
    with cuda_target():
        return jax.jit(f).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def triton_kernels_text(lowered) -> list[str]:
    """The Triton IR (text) of every Triton kernel call in ``lowered`` (a Lowered for CUDA).

    Pallas serializes each kernel's Triton module as MLIR bytecode into the custom call's backend
    config; reading it back shows what Triton will compile, e.g. each ``tt.dot``'s
    ``inputPrecision`` (printed only when it is not the default, ``ieee``). Uses jaxlib's MLIR
    bindings and Triton dialect (``jax._src.lib``: private, present in JAX 0.10 to 0.12)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    calls = []

    def walk(op):
        if op.name == "stablehlo.custom_call" and "triton" in str(op.attributes["call_target_name"]):
            calls.append(op)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = []
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        context = ir.Context()
        tt_dialect.register_dialect(context)
        with context:
            texts.append(str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)))
    return texts
