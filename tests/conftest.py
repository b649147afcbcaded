"""Shared fixtures: tiny Hugging Face models built locally (never from the hub)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs (JAX's persistent cache and the compiled steps on disk) go to a directory of this
# session, removed at its end, not the user's ~/.cache/paged_jax/jax_cache; set
# PAGED_JAX_COMPILE_CACHE to keep them elsewhere. Child processes of the tests inherit it.
if "PAGED_JAX_COMPILE_CACHE" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="paged-jax-test-cache-")
    os.environ["PAGED_JAX_COMPILE_CACHE"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)

import pytest

from tests.hf_models import HF_VARIANTS, make_hf_model


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
