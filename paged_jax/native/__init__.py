"""Native CPU kernels, built on first use and called through the XLA FFI: ragged paged
attention (``paged_attention.cc``) and the model's matmuls against panel-packed weights
(``linear.cc``; W8A8's int8 x int8 in ``linear_int8.cc``).

Attention. XLA's CPU backend can only express paged decode attention by gathering every
sequence's K and V into a temporary and running many tiny batched matmuls: at
batch 32 that took about half of a GPT-2-124M decode step. ``paged_attention.cc``
reads K/V straight from the paged cache through the block table, on XLA's own thread
pool (``python experiments/roofline.py`` measures the decode step both ways), for a whole
ragged step at once (:func:`paged_attention`: decode rows and prefill chunks, token-flat,
each block of a chunk's queries reading its context once), so no query is padded to a tile.
It computes the same function as the jnp reference and is tested against it
(``tests/test_native_decode.py``, ``tests/test_native_ragged.py``).

Matmuls. At decode batch sizes XLA's CPU matmuls leave the cores waiting on weights that
stream from memory (and XLA turns a quantized weight into a float copy before its matmul). :func:`pack_params` turns each float32 ``DenseLinear`` (weight ``[K, N]``)
into a ``PanelLinear`` holding ``[N / W, K, W]`` panels (W = 48, 32 or 16 columns, each panel
contiguous; see ``paged_jax.models.weights``), whose matmul is :func:`linear`, which prefetches
the panels ahead of use (``tests/test_native_linear.py``; ``experiments/roofline.py`` times
the step with and without). Quantized weights (int8, int4 packed two to a byte, or fp8 e4m3,
with scales and optional zero points per column or block and per group of rows, in activation
order or not; ``QuantizedLinear``) become ``PanelQuantizedLinear`` (:func:`pack_quantized`),
whose matmul :func:`linear_quantized` reads the quantized panels and turns them into float32 on
the way. W8A8 weights (int8 activations per token, int8 weights per column) become
``PanelInt8Linear`` (:func:`pack_int8`) where the library was built with AVX-512 VNNI: an
integer matmul, :func:`linear_int8`. The runner packs on a CPU with one device; float32 weights
only where the matmul was built with its AVX-512 tiles (:func:`packs_weights`).

The library is compiled with the system's C++ compiler the first time it is
needed, into ``$PAGED_JAX_HOME/native`` (default ``~/.cache/paged_jax/native``),
keyed by the sources, the compiler flags, jaxlib's version and this CPU; extra flags
come from ``PAGED_JAX_NATIVE_FLAGS``. The attention kernel and the matmuls use AVX-512 (the int8
x int8 one AVX-512 VNNI) where the CPU has it and portable loops elsewhere (the float32 matmul's are
correct but slower than XLA's matmul); :func:`paths` says which a build compiled in, and
``status()["traced"]`` which kernels ran. When no compiler is found or the build fails,
:func:`available` is False, a warning says why, and everything runs in XLA (plain
weights, jnp decode attention). ``PAGED_JAX_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
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

from paged_jax import envs  # a leaf module: native imports nothing else of paged_jax from here

logger = logging.getLogger("paged_jax")

SOURCES = [Path(__file__).with_name(f) for f in ("paged_attention.cc", "linear.cc", "linear_int8.cc")]
HEADERS = [Path(__file__).with_name(f) for f in ("parallel.h", "fp8.h")]
TARGETS = {"float32": ("paged_jax_paged_attention_f32", "PagedAttentionF32"),
           "bfloat16": ("paged_jax_paged_attention_bf16", "PagedAttentionBF16")}
# float32 queries over an 8-bit KV cache with a float16 scale per token and head (paged_jax.attention.kv_quant),
# by the cache array's dtype: int8 values, or fp8 e4m3 bits in uint8
QUANTIZED_ATTENTION_TARGETS = {"int8": ("paged_jax_paged_attention_q8", "PagedAttentionQ8"),
                            "uint8": ("paged_jax_paged_attention_fp8", "PagedAttentionFp8")}
TARGET = TARGETS["float32"][0]
LINEAR_TARGET = ("paged_jax_linear_f32", "LinearF32")
SUM_TARGET = ("paged_jax_sum_f32", "SumF32")
# quantized weights against float32 activations, by the panels' dtype (uint8: int4, two to a byte)
QUANTIZED_TARGETS = {"int8": ("paged_jax_linear_q8", "LinearQ8F32"), "uint8": ("paged_jax_linear_q4", "LinearQ4F32"),
                     "float8_e4m3fn": ("paged_jax_linear_fp8", "LinearFp8F32")}
INT8_TARGET = ("paged_jax_linear_i8i8", "LinearI8I8")  # W8A8: int8 activations x int8 weights
PANEL_WIDTHS = (48, 32, 16)
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w"]


def _flags() -> list[str]:
    """FLAGS, then any from ``PAGED_JAX_NATIVE_FLAGS`` (e.g. ``-mno-avx512f`` for the portable loops)."""
    return [*FLAGS, *envs.native_flags()]


_lock = threading.Lock()
# "ok": bool, "error": str, "library": path, "flags": str, "avx512_matmul", "vnni_matmul", "avx512_attention": bool
_state: dict = {}
# The kernels (by the names of KERNELS) this process has put into a computation. Which instruction
# set each runs is fixed when the library is built (see paths()): together they say what a test run
# exercised on the CPU it landed on.
_traced: set = set()
KERNELS = ("attention float32", "attention bfloat16", "attention int8 cache", "attention fp8 cache", "linear float32",
           "linear int8", "linear int4", "linear fp8", "linear int8 x int8")
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
    import jax.ffi

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [*shlex.split(cxx), *_flags(), f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
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
    """Build (once per machine) and register the kernels; False, with a warning, if that fails."""
    if not envs.native_enabled():
        return False
    with _lock:
        if "ok" not in _state:
            try:
                import jax.ffi

                path = _library_path()
                if not path.is_file():
                    _build(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                for target, symbol in (*TARGETS.values(), *QUANTIZED_ATTENTION_TARGETS.values(), LINEAR_TARGET, SUM_TARGET,
                                       *QUANTIZED_TARGETS.values(), INT8_TARGET):
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state.update(ok=True, library=str(path), flags=" ".join(_flags()),
                              avx512_matmul=bool(lib.PagedJaxLinearAvx512()),
                              vnni_matmul=bool(lib.PagedJaxLinearVnni()), avx512_attention=bool(lib.PagedJaxAttentionAvx512()))
            except Exception as e:  # no compiler, a failed build, an FFI this jaxlib lacks: run the jnp path
                _state.update(ok=False, error=str(e))
                logger.warning("native CPU kernels unavailable, using XLA's (jnp decode attention, XLA "
                               "matmuls): %s", e)
        return _state["ok"]


def status() -> dict:
    """{"ok": ..., "library" or "error": ...} after :func:`available` was asked; once built, also
    "flags" (the compiler's), "paths" (:func:`paths`), "traced" (the kernels this process has put
    into a computation, sorted) and "cpu_isa" (:func:`cpu_isa`)."""
    out = dict(_state)
    if out.get("ok"):
        out.update(paths=paths(), traced=sorted(_traced), cpu_isa=cpu_isa())
    return out


def paths() -> dict:
    """Which code each kernel of the built library runs, compiled in or out by the instruction set
    it was built for: {"attention", "linear float32", "linear quantized": "avx512" | "portable",
    "linear int8 x int8": "vnni" | "portable"}; {} before a successful build."""
    if not _state.get("ok"):
        return {}
    avx = {True: "avx512", False: "portable"}
    return {"attention": avx[_state["avx512_attention"]], "linear float32": avx[_state["avx512_matmul"]],
            "linear quantized": avx[_state["avx512_matmul"]],
            "linear int8 x int8": "vnni" if _state["vnni_matmul"] else "portable"}


def _trace(kernel: str) -> None:
    _traced.add(kernel)


def _dtype(q, k_cache, v_cache) -> Optional[str]:
    """The one dtype of the three operands when the kernel has a variant for it, else None."""
    dtypes = {str(x.dtype) for x in (q, k_cache, v_cache)}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(TARGETS) else None


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, sliding_window: Optional[int] = None,
                 logit_soft_cap: Optional[float] = None) -> "jax.Array":
    """Same contract as :func:`paged_jax.attention.decode.paged_decode_attention`: one query per row
    (:func:`paged_attention` with rows of one query each); rows with ``context_lens <= 0`` give zeros."""
    import jax.numpy as jnp

    S = q.shape[0] if q.ndim == 3 else -1
    context_lens = jnp.asarray(context_lens)
    return paged_attention(q, k_cache, v_cache, block_tables, context_lens, jnp.arange(max(S, 0), dtype=jnp.int32),
                           (context_lens > 0).astype(jnp.int32), scale, sliding_window, logit_soft_cap)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_starts, query_lens, scale: float,
                    sliding_window: Optional[int] = None, logit_soft_cap: Optional[float] = None) -> "jax.Array":
    """Causal attention of token-flat queries over the paged cache, a whole ragged step at once.

    q ``[T, H, D]``; row ``s`` (of ``block_tables [S, max_blocks]``) owns the ``query_lens[s]``
    tokens from ``query_starts[s]``, its ``i``-th at position ``context_lens[s] - query_lens[s] + i``,
    which sees that row's keys up to its position (and, with ``sliding_window``, after its position
    less the window; ``logit_soft_cap``: scores become ``cap * tanh(scores / cap)``). Returns ``[T, H, D]``; tokens no row owns are
    zeros. float32 or bfloat16, one dtype for all three, or 8-bit caches (int8 or fp8) in kv_quant's
    layout with any query dtype; float32 arithmetic."""
    import jax
    import jax.numpy as jnp

    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape or block_tables.ndim != 2 or \
            0 in k_cache.shape[:3]:
        raise ValueError(f"paged_attention takes q [T, H, D], caches [blocks, block_size, kv_heads, D] and tables "
                         f"[S, max_blocks]; got q {q.shape}, k {k_cache.shape}, v {v_cache.shape}, "
                         f"tables {block_tables.shape}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"paged_attention: sliding_window must be None or an integer >= 1, got {sliding_window!r}")
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"paged_attention: logit_soft_cap must be None or > 0, got {logit_soft_cap!r}")
    attrs = dict(scale=np.float32(scale), window=np.int64(sliding_window or 0), soft_cap=np.float32(logit_soft_cap or 0))
    T, H, D = q.shape
    S, KVH = block_tables.shape[0], k_cache.shape[2]
    rows = [jnp.asarray(x).astype(jnp.int32) for x in (block_tables, context_lens, query_starts, query_lens)]
    if any(x.shape != (S,) for x in rows[1:]):
        got = ", ".join(f"{name} {tuple(x.shape)}" for name, x in zip(("context_lens", "query_starts", "query_lens"), rows[1:]))
        raise ValueError(f"paged_attention: {S} rows of tables need context_lens, query_starts and query_lens of "
                         f"shape ({S},); got {got}")
    quantized = QUANTIZED_ATTENTION_TARGETS.get(str(k_cache.dtype))
    if quantized and v_cache.dtype == k_cache.dtype:  # an 8-bit cache: D values + a float16 scale
        if k_cache.shape[3] != D + 2 or H % KVH:
            raise ValueError(f"paged_attention over an 8-bit cache needs entries of head_dim + 2 = {D + 2} and kv_heads "
                             f"dividing {H}; got k {k_cache.shape}")
        _trace("attention int8 cache" if str(k_cache.dtype) == "int8" else "attention fp8 cache")
        out = jax.ffi.ffi_call(quantized[0], jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q.astype(jnp.float32), k_cache, v_cache, *rows, **attrs)
        return out.astype(q.dtype)
    if k_cache.shape[3] != D or H % KVH:
        raise ValueError(f"paged_attention: {H} query heads of {D} need kv_heads dividing {H} and head_dim {D}; got "
                         f"k {k_cache.shape}")
    dtype = _dtype(q, k_cache, v_cache)
    if dtype is None:
        raise ValueError(f"paged_attention takes {' or '.join(TARGETS)} for q and both caches alike; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _trace(f"attention {dtype}")
    return jax.ffi.ffi_call(TARGETS[dtype][0], jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_cache, v_cache, *rows, **attrs)


def packs_weights() -> bool:
    """Whether a runner on this CPU should pack its weights for :func:`linear`: the kernels are
    built, with the matmul's AVX-512 tiles (its portable loops run slower than XLA's matmul)."""
    return available() and bool(_state.get("avx512_matmul"))


def panel_width(n: int) -> Optional[int]:
    """The widest panel (48, 32 or 16 columns) that divides ``n`` output columns; None if none does."""
    return next((w for w in PANEL_WIDTHS if n % w == 0), None)


def pack_weight(w) -> "jax.Array":
    """``[K, N]`` -> ``[N / W, K, W]``: W-column panels, each contiguous (W from :func:`panel_width`)."""
    import jax.numpy as jnp

    if w.ndim != 2 or panel_width(w.shape[1]) is None:
        raise ValueError(f"pack_weight takes a [K, N] matrix with N a multiple of 16; got shape {w.shape}")
    K, N = w.shape
    W = panel_width(N)
    return jnp.asarray(w).reshape(K, N // W, W).transpose(1, 0, 2)


def unpack_weight(w_panels) -> "jax.Array":
    """The inverse of :func:`pack_weight`: ``[P, K, W]`` -> ``[K, P * W]``."""
    P, K, W = w_panels.shape
    return w_panels.transpose(1, 0, 2).reshape(K, P * W)


def linear(x, w_panels) -> "jax.Array":
    """``x @ unpack_weight(w_panels)`` for ``x [..., K]``: the native kernel for float32 on a CPU
    once the kernels are registered (a runner packs only then, and keeps using them even if
    ``PAGED_JAX_NATIVE=0`` is set later), else XLA's matmul on the unpacked weight."""
    import jax
    import jax.numpy as jnp

    if w_panels.ndim != 3 or w_panels.shape[2] not in PANEL_WIDTHS or x.shape[-1] != w_panels.shape[1]:
        raise ValueError(f"linear takes x [..., K] and panels [P, K, W] with W in {PANEL_WIDTHS}; got x {x.shape}, "
                         f"panels {w_panels.shape}")
    P, K, W = w_panels.shape
    if x.dtype != jnp.float32 or w_panels.dtype != jnp.float32 or jax.default_backend() != "cpu" or \
            not _state.get("ok"):
        return x @ unpack_weight(w_panels).astype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), K)
    _trace("linear float32")
    y = jax.ffi.ffi_call(LINEAR_TARGET[0], jax.ShapeDtypeStruct((x2.shape[0], P * W), jnp.float32))(x2, w_panels)
    return y.reshape(*lead, P * W)


def quantized_packable(p) -> bool:
    """Whether :func:`pack_quantized` takes a ``QuantizedLinear``: int8, int4 or fp8 e4m3 values
    with scales (and optionally zero points) per block of whole groups of rows (an even count for
    int4) and any columns (per column, per tensor, 2-D blocks), the groups contiguous or in
    activation order (``g_idx``: then every group must have as many rows as the others, as GPTQ
    writes them). Activations quantized at run time are taken where the weight's own matmul
    quantizes them and multiplies in float32 (W8A8 with int8 weights per column is an integer
    matmul: :func:`int8_packable`)."""
    import jax.numpy as jnp

    fmt = {jnp.dtype(jnp.int8): 8, jnp.dtype(jnp.uint8): 4, jnp.dtype(jnp.float8_e4m3fn): 8}.get(p.values.dtype)
    if fmt is None or fmt != p.bits:
        return False
    n_in, n_out = p.in_features, p.values.shape[1]
    rows, cols = p._block(n_out)
    groups = p.scale.shape[0]
    if p.integer_matmul:  # W8A8 per column: an integer matmul (pack_int8, or XLA's)
        return False
    if p.zero is not None and p.zero.shape != p.scale.shape:
        return False
    if p.g_idx is not None:
        g_idx = np.asarray(p.g_idx)
        if g_idx.shape != (n_in,) or g_idx.min() < 0 or g_idx.max() >= groups or \
                not np.all(np.bincount(g_idx, minlength=groups) == rows):
            return False
    return rows * groups == n_in and cols * p.scale.shape[1] >= n_out and (p.bits == 8 or rows % 2 == 0)


def pack_quantized(p):
    """A ``QuantizedLinear`` (see :func:`quantized_packable`) as (value panels ``[P, K', W]``, scale
    panels ``[P, G, W]`` float32, zero-point panels shaped as the scales (float32, in the values'
    units) or None, the row order or None), output columns padded to a panel width. A weight in
    activation order has its rows sorted by group (stably): row ``i`` of the packed weight is
    row ``order[i]`` of the original, so ``x[..., order] @ packed == x @ original``."""
    import jax.numpy as jnp

    from paged_jax.models.quantization import _pack_nibbles

    n_out = p.values.shape[1]
    cols = p._block(n_out)[1]
    values, order = p.values, None
    if p.g_idx is not None:
        order = np.argsort(np.asarray(p.g_idx), kind="stable").astype(np.int32)
        sorted_rows = np.asarray(p.unpacked())[order]
        values = _pack_nibbles(sorted_rows) if p.bits == 4 else sorted_rows
        order = jnp.asarray(order)

    def per_column(a):  # [G, column blocks] -> [G, n_out] float32
        return jnp.repeat(a.astype(jnp.float32), cols, axis=1)[:, :n_out]

    zero = None if p.zero is None else pack_padded(per_column(p.zero))
    return pack_padded(jnp.asarray(values)), pack_padded(per_column(p.scale)), zero, order


def linear_quantized(x, panels, scale_panels, bits: int, zero_panels=None) -> "jax.Array":
    """``x @ w`` for the weight held as :func:`pack_quantized` panels (rows already in the panels'
    order; int8, int4 two to a byte, or fp8 e4m3, by the panels' dtype): the native kernel for
    float32 on a CPU once the kernels are registered, else XLA on the dequantized weight."""
    import jax
    import jax.numpy as jnp

    P, rows, W = panels.shape
    G = scale_panels.shape[1]
    K = rows * (2 if bits == 4 else 1)
    if x.shape[-1] != K or scale_panels.shape != (P, G, W) or \
            zero_panels is not None and zero_panels.shape != (P, G, W):
        raise ValueError(f"linear_quantized: x {x.shape}, panels {panels.shape}, scales {scale_panels.shape}, "
                         f"zeros {None if zero_panels is None else zero_panels.shape} do not fit {bits}-bit values")
    if x.dtype != jnp.float32 or jax.default_backend() != "cpu" or not _state.get("ok"):
        q = unpack_weight(panels)
        if bits == 4:
            q = jnp.stack([q & 0xF, q >> 4], axis=1).reshape(K, -1).astype(jnp.int8) - 8
        w = q.astype(jnp.float32)
        if zero_panels is not None:
            w = w - jnp.repeat(unpack_weight(zero_panels), K // G, axis=0)
        w = w * jnp.repeat(unpack_weight(scale_panels), K // G, axis=0)
        return x @ w.astype(x.dtype)
    if zero_panels is None:
        zero_panels = jnp.zeros((P, 0, W), jnp.float32)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), K)
    _trace({"int8": "linear int8", "uint8": "linear int4"}.get(panels.dtype.name, "linear fp8"))
    y = jax.ffi.ffi_call(QUANTIZED_TARGETS[panels.dtype.name][0],
                         jax.ShapeDtypeStruct((x2.shape[0], P * W), jnp.float32))(x2, panels, scale_panels, zero_panels)
    return y.reshape(*lead, P * W)


def int8_packable(p) -> bool:
    """Whether :func:`pack_int8` takes a ``QuantizedLinear``: W8A8 (int8 activations per token,
    ``act="int8"``) with int8 weights and one scale per column or for the tensor, no zero points
    or activation order, and inputs a multiple of 4."""
    return p.integer_matmul and p.in_features % 4 == 0 and p.values.shape[0] == p.in_features


def pack_int8(p):
    """A W8A8 ``QuantizedLinear`` (see :func:`int8_packable`) as (panels ``[P, K / 4, W * 4]`` int8,
    each panel's rows interleaved four at a time per column, VNNI's operand layout; column sums
    ``[P, W]`` int32; scales ``[P, W]`` float32), output columns padded to a panel width."""
    import jax.numpy as jnp

    K, n_out = p.values.shape
    panels = pack_padded(p.values)  # [P, K, W], rows 4i .. 4i + 3 of a column then interleaved
    P, _, W = panels.shape
    panels = panels.reshape(P, K // 4, 4, W).transpose(0, 1, 3, 2).reshape(P, K // 4, W * 4)
    sums = pack_padded(jnp.sum(p.values, axis=0, dtype=jnp.int32)[None])[:, 0]
    scales = pack_padded(jnp.broadcast_to(p.scale.astype(jnp.float32), (1, n_out)))[:, 0]
    return panels, sums, scales


def linear_int8(xq, x_scale, panels, sums, scales) -> "jax.Array":
    """``(xq @ w) * x_scale * w_scale`` for int8 activations ``xq`` (``[..., K]``, with their
    per-token scales ``[..., 1]``) and a weight held as :func:`pack_int8` panels: the native kernel
    on a CPU once the kernels are registered, else XLA's int8 dot on the unpacked weight. float32."""
    import jax
    import jax.numpy as jnp

    P, quads, W4 = panels.shape
    K, W = quads * 4, W4 // 4
    if xq.shape[-1] != K or xq.dtype != jnp.int8 or sums.shape != (P, W) or scales.shape != (P, W):
        raise ValueError(f"linear_int8: x {xq.shape} {xq.dtype}, panels {panels.shape}, sums {sums.shape}, "
                         f"scales {scales.shape} do not fit")
    lead = xq.shape[:-1]
    xs = x_scale.reshape(lead).astype(jnp.float32)
    if jax.default_backend() != "cpu" or not _state.get("ok"):
        w = panels.reshape(P, quads, W, 4).transpose(1, 3, 0, 2).reshape(K, P * W)
        acc = jax.lax.dot_general(xq, w, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xs[..., None] * scales.reshape(P * W)
    m = math.prod(lead)
    _trace("linear int8 x int8")
    y = jax.ffi.ffi_call(INT8_TARGET[0], jax.ShapeDtypeStruct((m, P * W), jnp.float32))(
        xq.reshape(m, K), xs.reshape(m), panels, sums, scales)
    return y.reshape(*lead, P * W)


def read_sum(x) -> "jax.Array":
    """The float32 sum of ``x`` (any shape), read as the native matmul reads its weights
    (prefetched, shared over XLA's threads): the bandwidth probe of ``experiments/roofline.py``."""
    import jax
    import jax.numpy as jnp

    if x.dtype != jnp.float32:
        raise ValueError(f"read_sum takes float32, got {x.dtype}")
    return jax.ffi.ffi_call(SUM_TARGET[0], jax.ShapeDtypeStruct((), jnp.float32))(x)


def pack_padded(w) -> "jax.Array":
    """``[K, N]`` as panels: :func:`pack_weight` when a panel width divides N, else 48-column
    panels with N padded by zero columns (the caller cuts the outputs past N off)."""
    import jax.numpy as jnp

    if panel_width(w.shape[1]):
        return pack_weight(w)
    return pack_weight(jnp.pad(jnp.asarray(w), ((0, 0), (0, -w.shape[1] % PANEL_WIDTHS[0]))))


def pack_params(params, floats: bool = True):
    """A copy of a model's params with each float32 weight object stored for the native matmul:
    a ``DenseLinear`` becomes a ``PanelLinear``, a ``QuantizedLinear`` the kernel takes a
    ``PanelQuantizedLinear``, a tied ``DenseEmbedding`` (the LM head too) a
    ``PanelEmbedding`` (its transpose packed, which lookups read too: no second copy). Chosen by
    type (``paged_jax.models.weights``), not by name; everything else stays as it was.
    ``floats=False``: the quantized weights only (without AVX-512 the float matmul's portable loops
    are slower than XLA's; the quantized one's are still far faster than XLA's dequantize-then-dot)."""
    import jax.numpy as jnp

    from paged_jax.models.weights import (DenseEmbedding, DenseLinear, PanelEmbedding, PanelInt8Linear, PanelLinear,
                                          PanelQuantizedLinear, QuantizedLinear, map_weights)

    def pack(x):
        if isinstance(x, QuantizedLinear) and _state.get("vnni_matmul") and int8_packable(x):
            panels, sums, scales = pack_int8(x)
            return PanelInt8Linear(panels, sums, scales, x.b, out_features=x.values.shape[1], parallel=x.parallel)
        if isinstance(x, QuantizedLinear) and quantized_packable(x):
            panels, scales, zeros, order = pack_quantized(x)
            return PanelQuantizedLinear(panels, scales, zeros, order, x.b, bits=x.bits, act=x.act,
                                        out_features=x.values.shape[1], parallel=x.parallel)
        if floats and isinstance(x, DenseLinear) and x.w.ndim == 2 and x.w.dtype == jnp.float32:
            return PanelLinear(pack_padded(x.w), x.b, out_features=x.w.shape[1], parallel=x.parallel)
        if floats and isinstance(x, DenseEmbedding) and x.tied and x.table.dtype == jnp.float32:
            return PanelEmbedding(pack_padded(x.table.T), vocab_size=x.table.shape[0], parallel=x.parallel)
        return x

    return map_weights(pack, params)


__all__ = ["available", "status", "paths", "cpu_isa", "paged_attention", "paged_decode", "packs_weights", "panel_width",
           "pack_weight", "unpack_weight", "pack_padded", "linear", "pack_params", "read_sum", "quantized_packable",
           "pack_quantized", "linear_quantized"]
