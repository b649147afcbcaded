"""A native CPU decode-attention kernel, built on first use and called through the XLA FFI.

XLA's CPU backend can only express paged decode attention by gathering every
sequence's K and V into a temporary and running many tiny batched matmuls: at
batch 32 that took about half of a GPT-2-124M decode step. ``paged_decode.cc``
reads K/V straight from the paged cache through the block table, one sequence
per task, on XLA's own thread pool (``python experiments/roofline.py`` measures
the step both ways). It computes the same function as the jnp reference and is
tested against it (``tests/test_native_decode.py``).

The library is compiled with the system's C++ compiler the first time it is
needed (float32 and bfloat16 variants), into ``$PAGED_JAX_HOME/native`` (default ``~/.cache/paged_jax/native``),
keyed by the source, the compiler flags, jaxlib's version and this CPU. When no
compiler is found or the build fails, :func:`available` is False, a warning says
why, and decode attention runs in jnp. ``PAGED_JAX_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np

logger = logging.getLogger("paged_jax")

SOURCE = Path(__file__).with_name("paged_decode.cc")
TARGETS = {"float32": ("paged_jax_paged_decode_f32", "PagedDecodeF32"),
           "bfloat16": ("paged_jax_paged_decode_bf16", "PagedDecodeBF16")}
TARGET = TARGETS["float32"][0]
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w"]

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "error": str, "library": path


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _library_path() -> Path:
    import jaxlib

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), _cpu_key().encode()):
        h.update(part)
    root = Path(os.environ.get("PAGED_JAX_HOME", Path.home() / ".cache" / "paged_jax"))
    return root / "native" / f"paged_decode-{h.hexdigest()[:16]}.so"


def _build(out: Path) -> None:
    import jax.ffi

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [*shlex.split(cxx), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it private; others sharing the cache may load it
        os.replace(tmp, out)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if that fails."""
    if os.environ.get("PAGED_JAX_NATIVE", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            try:
                import jax.ffi

                path = _library_path()
                if not path.is_file():
                    _build(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                for target, symbol in TARGETS.values():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state.update(ok=True, library=str(path))
            except Exception as e:  # no compiler, a failed build, an FFI this jaxlib lacks: run the jnp path
                _state.update(ok=False, error=str(e))
                logger.warning("native CPU decode attention unavailable, using jnp: %s", e)
        return _state["ok"]


def status() -> dict:
    """{"ok": ..., "library" or "error": ...} after :func:`available` was asked."""
    return dict(_state)


def _dtype(q, k_cache, v_cache) -> Optional[str]:
    """The one dtype of the three operands when the kernel has a variant for it, else None."""
    dtypes = {str(x.dtype) for x in (q, k_cache, v_cache)}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(TARGETS) else None


def supports(q, k_cache, v_cache) -> bool:
    """Whether :func:`paged_decode` can run these operands here (all float32 or all bfloat16,
    CPU, kernel built)."""
    import jax

    return _dtype(q, k_cache, v_cache) is not None and jax.default_backend() == "cpu" and available()


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> "jax.Array":
    """Same contract as :func:`paged_jax.attention.decode.paged_decode_attention` (float32 or
    bfloat16, one dtype for all three; float32 arithmetic); rows with ``context_lens <= 0`` give zeros."""
    import jax
    import jax.numpy as jnp

    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape or block_tables.ndim != 2 or \
            0 in k_cache.shape[:2]:
        raise ValueError(f"paged_decode takes q [S, H, D], caches [blocks, block_size, kv_heads, D] and tables "
                         f"[S, max_blocks]; got q {q.shape}, k {k_cache.shape}, v {v_cache.shape}, "
                         f"tables {block_tables.shape}")
    S, H, D = q.shape
    KVH = k_cache.shape[2]
    if k_cache.shape[3] != D or H % KVH or block_tables.shape[0] != S or context_lens.shape != (S,):
        raise ValueError(f"paged_decode: {H} query heads of {D} need kv_heads dividing {H} and head_dim {D}, and "
                         f"{S} rows of tables and lengths; got k {k_cache.shape}, tables {block_tables.shape}, "
                         f"context_lens {context_lens.shape}")
    dtype = _dtype(q, k_cache, v_cache)
    if dtype is None:
        raise ValueError(f"paged_decode takes {' or '.join(TARGETS)} for q and both caches alike; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    return jax.ffi.ffi_call(TARGETS[dtype][0], jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_cache, v_cache, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
        scale=np.float32(scale))


__all__ = ["available", "status", "supports", "paged_decode"]
