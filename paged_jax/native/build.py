"""Building the native library (once per machine, keyed by its sources, flags, jaxlib and CPU),
registering its kernels with XLA's FFI, and saying which instruction-set paths it compiled in."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
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

from paged_jax import envs  # a leaf module: native imports nothing else of paged_jax

logger = logging.getLogger("paged_jax")

# The slowest to compile first: the build compiles them side by side (_build).
SOURCES = [Path(__file__).with_name(f) for f in ("paged_attention.cc", "linear.cc", "linear_quantized.cc",
                                                      "linear_int8.cc", "linear_int4.cc", "grouped_linear.cc",
                                                      "rms_norm.cc")]
HEADERS = [Path(__file__).with_name(f) for f in ("parallel.h", "fp8.h", "panel_tiles.h", "attention_loops.h",
                                                  "attention_tiles.h", "attention_item.h")]
TARGETS = {"float32": ("paged_jax_paged_attention_f32", "PagedAttentionF32"),
           "bfloat16": ("paged_jax_paged_attention_bf16", "PagedAttentionBF16")}
# float32 queries over an 8-bit KV cache with a float16 scale per token and head (paged_jax.attention.kv_quant),
# by the cache array's dtype: int8 values, or fp8 e4m3 bits in uint8
QUANTIZED_ATTENTION_TARGETS = {"int8": ("paged_jax_paged_attention_q8", "PagedAttentionQ8"),
                            "uint8": ("paged_jax_paged_attention_fp8", "PagedAttentionFp8")}
# float32 queries and output over a bfloat16 cache held as uint16 bits (kv_cache_dtype="bfloat16", kv_quant)
WIDENED_ATTENTION_TARGET = ("paged_jax_paged_attention_f32_bf16", "PagedAttentionF32BF16")
LINEAR_TARGET = ("paged_jax_linear_f32", "LinearF32")
SUM_TARGET = ("paged_jax_sum_f32", "SumF32")
# quantized weights against float32 activations, by the panels' dtype (uint8: int4, two to a byte)
QUANTIZED_TARGETS = {"int8": ("paged_jax_linear_q8", "LinearQ8F32"), "uint8": ("paged_jax_linear_q4", "LinearQ4F32"),
                     "float8_e4m3fn": ("paged_jax_linear_fp8", "LinearFp8F32")}
# those kernels' names (in quantized_native_rows and the traced paths' "linear <name>"), by the same dtype
QUANTIZED_KERNELS = {"int8": "int8", "uint8": "int4", "float8_e4m3fn": "fp8"}
INT8_TARGET = ("paged_jax_linear_i8i8", "LinearI8I8")  # W8A8: int8 activations x int8 weights
GROUPED_TARGET = ("paged_jax_grouped_linear_f32", "GroupedLinearF32")  # a mixture's experts, rows sorted by expert
# symmetric int4 weights x float32 activations quantized to int8 per block of 32 in the kernel (q4_0 x q8_0)
INT4_TARGET = ("paged_jax_linear_q4i8", "LinearQ4I8")
RMS_NORM_TARGET = ("paged_jax_rms_norm_f32", "RmsNormF32")  # a float32 RMS norm in one operation
PANEL_WIDTHS = (48, 32, 16)
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w"]


def _flags() -> list[str]:
    """FLAGS, then any from ``PAGED_JAX_NATIVE_FLAGS`` (e.g. ``-mno-avx512f`` for the portable loops)."""
    return [*FLAGS, *envs.native_flags()]


_lock = threading.Lock()
# "ok": bool, "error": str, "library": path, "flags": str, "linear_isa", "int8_isa": int (2 AVX-512 / VNNI,
# 1 AVX2, 0 portable), "int8_matmul" (an int8 x int8 kernel with integer instructions: VNNI or AVX2),
# "vnni_matmul": bool, "attention_isa": int (2 AVX-512, 1 AVX2, 0 portable)
_state: dict = {}
# The kernels (by the names of KERNELS) this process has put into a computation. Which instruction
# set each runs is fixed when the library is built (see paths()): together they say what a test run
# exercised on the CPU it landed on.
_traced: set = set()
KERNELS = ("attention float32", "attention bfloat16", "attention bfloat16 cache", "attention int8 cache",
           "attention fp8 cache", "linear float32",
           "linear int8", "linear int4", "linear fp8", "linear int8 x int8", "linear int4 x int8",
           "linear grouped float32", "rms norm float32")
CPU_ISA = ("avx2", "avx512f", "avx512_vnni")  # the extensions the kernels' paths are chosen by


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cpu_isa() -> list:
    """Which of :data:`CPU_ISA` this CPU has (by ``/proc/cpuinfo``): a build for it (``-march=native``)
    compiles the AVX-512 paths only with ``avx512f``, the int8 x int8 one only with ``avx512_vnni`` too."""
    flags = set(_cpu_key().split())
    return [f for f in CPU_ISA if f in flags]


def _library_path() -> Path:
    import jaxlib

    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    for part in (" ".join(_flags()), jaxlib.__version__, _cpu_key()):
        h.update(part.encode())
    return envs.home() / "native" / f"paged_jax_native-{h.hexdigest()[:16]}.so"


def _build(out: Path) -> None:
    """Compile each source to an object file, as many at once as this process has cores, then link
    them (on 2 cores: 30 s, against 57 s for one compiler call over every source)."""
    import jax.ffi
    from concurrent.futures import ThreadPoolExecutor

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objects:
            def run(cmd):
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if res.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")

            compiler = [*shlex.split(cxx), *_flags()]
            include = f"-I{jax.ffi.include_dir()}"
            objs = [str(Path(objects) / f"{src.stem}.o") for src in SOURCES]
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            with ThreadPoolExecutor(min(cores, len(SOURCES))) as pool:  # in SOURCES' order: the slowest first
                list(pool.map(run, [[*compiler, include, "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objs)]))
            run([*compiler, *objs, "-o", tmp])
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it private; others sharing the cache may load it
        os.replace(tmp, out)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _build_lock(out: Path):
    """Held while a process builds ``out``: processes starting together on a fresh machine (test
    workers, servers) build it once, the others wait and load it, rather than each compiling the
    same library on the same cores."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_built(path: Path) -> None:
    """Build the library at ``path`` unless it is there, or another process builds it meanwhile."""
    if not path.is_file():
        with _build_lock(path):
            if not path.is_file():  # another process may have built it while this one waited
                _build(path)


def available() -> bool:
    """Build (once per machine) and register the kernels; False, with a warning, if that fails."""
    if not envs.native_enabled():
        return False
    with _lock:
        if "ok" not in _state:
            try:
                import jax.ffi

                path = _library_path()
                _ensure_built(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                for target, symbol in (*TARGETS.values(), *QUANTIZED_ATTENTION_TARGETS.values(), WIDENED_ATTENTION_TARGET,
                                       LINEAR_TARGET, SUM_TARGET,
                                       *QUANTIZED_TARGETS.values(), INT8_TARGET, INT4_TARGET, GROUPED_TARGET,
                                       RMS_NORM_TARGET):
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state.update(ok=True, library=str(path), flags=" ".join(_flags()),
                              linear_isa=int(lib.PagedJaxLinearIsa()), int8_isa=int(lib.PagedJaxLinearInt8Isa()),
                              int8_matmul=lib.PagedJaxLinearInt8Isa() > 0, vnni_matmul=lib.PagedJaxLinearInt8Isa() == 2,
                              attention_isa=int(lib.PagedJaxAttentionIsa()), int4_isa=int(lib.PagedJaxLinearInt4Isa()))
            except Exception as e:  # no compiler, a failed build, an FFI this jaxlib lacks: run the jnp path
                _state.update(ok=False, error=str(e))
                logger.warning("native CPU kernels unavailable, using XLA's (jnp decode attention, XLA "
                               "matmuls): %s", e)
        return _state["ok"]


def status() -> dict:
    """{"ok": ..., "library" or "error": ...} after :func:`available` was asked; once built, also
    "flags" (the compiler's), "paths" (:func:`paths`), "traced" (the kernels this process has put
    into a computation, sorted), "cpu_isa" (:func:`cpu_isa`) and "quantized_native_rows" (by the
    quantized values' dtype, :func:`quantized_native_rows`: the most rows a step's quantized matmul
    gives the native kernel, None for all)."""
    out = dict(_state)
    if out.get("ok"):
        out.update(paths=paths(), traced=sorted(_traced), cpu_isa=cpu_isa(),
                   quantized_native_rows={k: quantized_native_rows(k) for k in QUANTIZED_NATIVE_ROWS})
    return out


def paths() -> dict:
    """Which code each kernel of the built library runs, compiled in or out by the instruction set
    it was built for: {"attention", "linear float32", "linear quantized":
    "avx512" | "avx2" | "portable", "linear int8 x int8", "linear int4 x int8": "vnni" | "avx2" |
    "portable"}; {} before a successful build."""
    if not _state.get("ok"):
        return {}
    linear = LINEAR_PATHS[_state["linear_isa"]]
    return {"attention": LINEAR_PATHS[_state["attention_isa"]], "linear float32": linear,
            "linear quantized": linear, "linear int8 x int8": INT8_PATHS[_state["int8_isa"]],
            "linear int4 x int8": INT8_PATHS[_state["int4_isa"]]}


LINEAR_PATHS = ("portable", "avx2", "avx512")  # by the library's PagedJaxLinearIsa() (and PagedJaxAttentionIsa())
INT8_PATHS = ("portable", "avx2", "vnni")  # by PagedJaxLinearInt8Isa()


def trace(kernel: str) -> None:
    """Record that ``kernel`` (one of :data:`KERNELS`) was put into a computation."""
    _traced.add(kernel)


def loaded() -> bool:
    """Whether the library was built and its kernels registered in this process (by :func:`available`).
    The FFI wrappers call the kernels only then; otherwise they compute the same function in XLA."""
    return bool(_state.get("ok"))


# Rows of x per step up to which each quantized matmul runs its native kernel; past them, XLA
# dequantizes the same panels to float32 and runs its own matmul (the dequantizing pass paid once a
# step, not once per row); None: the native kernel at every row count. By kernel: "int8", "int4",
# "fp8" (the float32 tiles over values turned into float32 on the way) and "int4 x int8" (integer
# dot products on the nibbles against activations quantized to int8, quantization="int4"). With
# AVX-512 the native kernels were the faster at every row count measured (up to 256).
#
# An AVX-512 CPU running the AVX2 build (-mno-avx512f; XLA held to AVX2) or the portable loops:
# XLA's float32 dots still run AVX-512 kernels there (YNNPACK picks them at run time), so XLA wins
# early. Measured per layer matmul of a LLaMA 512 wide at 1-256 rows: fp8 ahead to 32 and even at
# 64, int4 ahead to 64 and even at 128 (1.2x behind at 192). int8 keeps the kernel at every row
# count: in the engine's steps XLA's dequantize-then-matmul lost to it at every batch (decode
# tokens/s with int8 prefills and decode steps all native against XLA's past 16 rows: 1.8x at batch
# 8, 4.6x at batch 32, experiments/bench_isa_decode.py's model with AVX-512 turned off).
QUANTIZED_NATIVE_ROWS = {"int8": None, "int4": 64, "fp8": 32, "int4 x int8": 64}
# A CPU with only AVX2 (2 cores of an AMD EPYC, Zen 3; the layer matmuls of a LLaMA 512 wide, native
# kernel against XLA's dequantize-then-matmul at 16-1,024 rows, interleaved in one process, two
# runs): the float32 tiles over int4 / fp8 values 0.98-3.4x XLA's up to 256 rows, 0.88-1.03x past
# it; the int4 x int8 kernel (vpmaddubsw: 32 multiply-adds an instruction, an FMA's 8) ahead or even
# at every row count (1.3x at 256, 1.2x at 512, 1.0x at 1,024), and at 0.97-1.37x XLA's float32
# matmul on float32 weights from 256 rows on.
QUANTIZED_NATIVE_ROWS_AVX2_CPU = {"int8": None, "int4": 256, "fp8": 256, "int4 x int8": None}


def quantized_native_rows(kernel: str):
    """The most rows of x a step's quantized matmul (``kernel``: "int8", "int4", "fp8" or "int4 x
    int8", see :data:`QUANTIZED_NATIVE_ROWS`) runs through the native kernel, XLA's
    dequantize-then-dot above; None: the native kernel at every row count (AVX-512 builds, int8 on
    every build, or before a build). Builds without AVX-512 take :data:`QUANTIZED_NATIVE_ROWS`, or
    :data:`QUANTIZED_NATIVE_ROWS_AVX2_CPU` on a CPU that has no AVX-512 either."""
    if kernel not in QUANTIZED_NATIVE_ROWS:
        raise ValueError(f"quantized_native_rows: kernel must be one of {list(QUANTIZED_NATIVE_ROWS)}, got {kernel!r}")
    if _state.get("linear_isa", 2) == 2:
        return None
    return (QUANTIZED_NATIVE_ROWS_AVX2_CPU if _avx2_build_on_an_avx2_cpu() else QUANTIZED_NATIVE_ROWS)[kernel]


def _avx2_build_on_an_avx2_cpu() -> bool:
    """Whether the matmuls were built with their AVX2 tiles on a CPU without AVX-512 (where XLA's
    float32 dots have no AVX-512 kernels to run either)."""
    return _state.get("linear_isa") == 1 and "avx512f" not in cpu_isa()


def packs_weights() -> bool:
    """Whether a runner on this CPU should pack its float32 weights for :func:`linear`: the kernels
    are built, with the matmul's AVX-512 tiles, or with its AVX2 tiles on a CPU without AVX-512.

    On a CPU with only AVX2 (2 cores of an AMD EPYC, ``experiments/bench_isa_decode.py --batches 1 4
    8 32``), the AVX2 panels decode 1.17-1.37x / 1.64-1.99x / 1.58-1.76x / 1.28-1.36x the tokens/s of
    XLA's float32 matmul at batch 1 / 4 / 8 / 32, and ``bench_matmul_isa.py`` has them at 0.90-1.01x
    XLA's at 128-512 rows (prefill). An AVX-512 CPU running the AVX2 build (``-mno-avx512f``) keeps
    XLA's matmul: XLA's float32 dots still run AVX-512 kernels there (YNNPACK picks them at run
    time), and beat the AVX2 tiles at batch 8 (0.83x). The portable loops lose everywhere.
    Quantized weights are packed wherever the kernels are built."""
    if not available():  # first: it loads the library, which sets the matmul's instruction set
        return False
    return _state.get("linear_isa", 0) == 2 or _avx2_build_on_an_avx2_cpu()
