"""Shared fixtures: tiny Hugging Face models built locally (never from the hub)."""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _jax_has_a_gpu_plugin() -> bool:
    """Whether JAX's CUDA plugin is installed, read from the installed distributions (importing
    JAX here would fix its platform before the choice below)."""
    return any((d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda"))
               for d in importlib.metadata.distributions())


# Where JAX could find a GPU, the session uses it (the `gpu`-marked tests run there): only a machine
# without JAX's CUDA plugin is pinned to the CPU, and an explicit JAX_PLATFORMS always wins. On a GPU,
# JAX's default float32 matmul is TF32 (about 1e-3 relative): the float32 oracles, and the engine
# compared with them, run at full float32 precision unless JAX_DEFAULT_MATMUL_PRECISION says otherwise.
if _jax_has_a_gpu_plugin():
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU the tests have XLA generate its code without LLVM's optimizations (-O0): the same HLO
# programs, fusions and library calls (and the native kernels, built apart), only compiled sooner. The
# tests run tiny models through hundreds of step shapes, so compiling is most of their time: the
# default set took 13:14 against 17:42 at XLA's default, in 2 workers on 2 cores. XLA_FLAGS, if set, wins.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
# Compiled programs (JAX's persistent cache and the compiled steps on disk) go to a directory of this
# session, removed at its end, not the user's ~/.cache/paged_jax/jax_cache; set
# PAGED_JAX_COMPILE_CACHE to keep them elsewhere. Child processes of the tests inherit it.
if "PAGED_JAX_COMPILE_CACHE" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="paged-jax-test-cache-")
    os.environ["PAGED_JAX_COMPILE_CACHE"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)

import pytest

from tests.hf_models import HF_VARIANTS, make_hf_model


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker a core this process may run on. xdist's own count
    asks psutil first, which counts the whole machine's cores where a container is given a few."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def pytest_configure(config):
    from tests import native_paths

    native_paths.register(config)  # the "native kernel paths" section, printed where a native test ran


@pytest.fixture(scope="session", autouse=True)
def _torch_on_one_thread():
    """transformers (the oracle, where installed) runs models 64 wide: a second intra-op thread only
    spins against JAX's threads, and on 2 busy cores made ``generate`` up to 30x slower."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """hf_model_dir(variant) -> folder of a tiny random HF model saved with save_pretrained."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = make_hf_model(variant, tmp_path_factory.mktemp(variant))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from paged_jax.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", seed=0)


__all__ = ["HF_VARIANTS"]
