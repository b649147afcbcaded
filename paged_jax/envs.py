"""Every environment variable paged-jax reads, in one place (the README's "Environment variables"
table lists the same). Each is read when it is asked for, not at import, so a test or a process
may set it before it builds an engine. Plain Python, no JAX.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

# name -> what it does (the README's table is checked against this by tests/test_envs.py)
VARIABLES = {
    "PAGED_JAX_HOME": "where the native kernels are built and the benchmarks' models are kept "
                      "(default ~/.cache/paged_jax)",
    "PAGED_JAX_NATIVE": "0: no native CPU kernels (XLA's matmuls and the jnp attention)",
    "PAGED_JAX_NATIVE_FLAGS": "extra compiler flags for the native kernels (e.g. -mno-avx512f: the AVX2 paths on an "
                              "AVX-512 CPU; -mno-avx512f -mno-avx2 -mno-fma: the portable loops)",
    "PAGED_JAX_COMPILE_CACHE": "the folder of JAX's persistent compilation cache and the compiled steps on disk "
                               "(default ~/.cache/paged_jax/jax_cache)",
    "PAGED_JAX_NO_COMPILE_CACHE": "set: neither cache is used",
    "PAGED_JAX_NO_EXECUTABLE_CACHE": "set: no compiled steps on disk (JAX's own cache stays)",
    "PAGED_JAX_EXECUTABLE_CACHE_MAX_MB": "the compiled steps' folder bound in MB (default 2048, least recently "
                                         "used go first)",
    "PAGED_JAX_API_KEY": "paged-jax serve: the API key when --api-key is not given",
}


def _get(name: str) -> str:
    assert name in VARIABLES, name  # every variable is documented above
    return os.environ.get(name, "")


def _user_cache() -> Path:
    """The default root of both homes below (the compilation cache stays there when PAGED_JAX_HOME moves)."""
    return Path.home() / ".cache" / "paged_jax"


def home() -> Path:
    return Path(_get("PAGED_JAX_HOME") or _user_cache())


def native_enabled() -> bool:
    return _get("PAGED_JAX_NATIVE") != "0"


def native_flags() -> list[str]:
    return shlex.split(_get("PAGED_JAX_NATIVE_FLAGS"))


def compile_cache_dir() -> Optional[Path]:
    """JAX's persistent compilation cache folder, or None when switched off."""
    if _get("PAGED_JAX_NO_COMPILE_CACHE"):
        return None
    return Path(_get("PAGED_JAX_COMPILE_CACHE") or _user_cache() / "jax_cache")


def executable_cache_dir(root=None) -> Optional[Path]:
    """The folder of compiled steps on disk, inside ``root`` (an engine's ``compile_cache_dir``) or the
    compilation cache's folder, or None when switched off."""
    root = Path(root) if root is not None else compile_cache_dir()
    return None if root is None or _get("PAGED_JAX_NO_EXECUTABLE_CACHE") else root / "executables"


def executable_cache_max_mb() -> str:
    """The raw bound (the executable cache parses it and says when it is not a number)."""
    return _get("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB")


def api_key() -> Optional[str]:
    return _get("PAGED_JAX_API_KEY") or None
