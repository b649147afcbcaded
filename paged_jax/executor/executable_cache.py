"""The on-disk cache of compiled step programs (and of the sampler's variants, see below): a fresh
process loads them instead of tracing, lowering and compiling.

JAX's persistent compilation cache (see ``enable_compilation_cache``) skips XLA's compile, but it
is keyed by the lowered program, so every step shape still pays for tracing and lowering (about
0.3 s each on the CPU). This cache stores the compiled executable itself
(``jax.experimental.serialize_executable``) under a key computed *without* tracing: everything
that decides the step's code, which is

- the versions of JAX and jaxlib, the platform and its devices, ``XLA_FLAGS``;
- the source of paged-jax (every ``.py`` file of ``paged_jax`` and ``pallas_kernels``) and the
  native kernels' library file, whose FFI targets the step calls;
- the model config (dtype, KV cache dtype and attention variants included) and the attention
  backend's name;
- the abstract params (pytree structure with its static fields, which carry the quantization
  and weight layout, and each leaf's shape and dtype) and KV cache (block size, pool size,
  storage dtype);
- the step's ``Batch.shape_key`` and ``all_logits``.

The runner sends the jitted functions it calls after the step (the sampler and ``_take_rows``) through
the same cache (:meth:`ExecutableCache.get_function`), under the same key with, in place of the
step's shape, the function's name and its arguments' abstract values (tree structure with static
fields, such as ``SamplingTensors``' flags, and each leaf's shape, dtype and sharding).

An entry is a file named by a hash of that key, holding the key's full text beside the executable:
a file whose text differs (a hash collision, a hand-copied file) is not loaded, and a file that
cannot be read or loaded is compiled again and overwritten, with a warning. Loading runs the
pickle-based ``deserialize_and_load``: the directory must be as trusted as the code itself.
Backends registered by user code (their Python hooks cannot be keyed without tracing) and
tensor-parallel runners are not cached here (they still have JAX's persistent cache).

Where: ``executables/`` inside JAX's cache directory (``~/.cache/paged_jax/jax_cache``, moved by
``PAGED_JAX_COMPILE_CACHE``); ``PAGED_JAX_NO_COMPILE_CACHE=1`` turns both off,
``PAGED_JAX_NO_EXECUTABLE_CACHE=1`` only this one.

Size: every source edit makes new keys, so old entries are pruned. After an entry is stored, if the
folder's entries add up to more than ``PAGED_JAX_EXECUTABLE_CACHE_MAX_MB`` megabytes (default 2048),
the least recently used ones (oldest modification time; loading an entry touches it) are deleted
until they fit. Another process may prune or replace the same files at the same time: a file that is
gone is skipped, and one deleted under a reader is compiled again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jaxlib
from jax.experimental import serialize_executable

from paged_jax import envs

logger = logging.getLogger("paged_jax")


def enable_compilation_cache(path: Optional[str] = None) -> None:
    """JAX's persistent compilation cache in ``path`` (default: :func:`paged_jax.envs.compile_cache_dir`,
    None when switched off): a second start of the same model skips compiling. It is process-wide
    (``jax.config``): the first engine that sets it chooses the folder, later ones keep it."""
    path = path or envs.compile_cache_dir()
    if path is None:
        return
    path = str(path)
    current = getattr(jax.config, "jax_compilation_cache_dir", None)
    if current:
        if current != path:
            logger.info("JAX's persistent compilation cache stays in %s (process-wide, set by an earlier engine); "
                        "this engine's compiled steps go to its own folder", current)
        return
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        logger.info("JAX's persistent compilation cache (jax.config, for the whole process): %s", path)
    except Exception as e:  # an old or new JAX without these options: run without the cache
        logger.info("persistent compilation cache unavailable: %s", e)


FORMAT = 1  # bump when the entry layout changes
DEFAULT_MAX_MB = 2048  # the folder's size bound, unless PAGED_JAX_EXECUTABLE_CACHE_MAX_MB says otherwise
ROOT = Path(__file__).resolve().parents[2]  # the checkout: paged_jax/ and pallas_kernels/
# An executable that JAX's persistent cache loaded serializes without some of its functions (XLA:CPU,
# jaxlib 0.10.2: "Function ... not found" when the stored copy runs), so an entry is written only
# from a fresh compile: one with an option that JAX keeps in its cache key (a dump setting, inert
# unless XLA dumps), so that no entry of the plain ``jit`` path is found, and with JAX's writes off
# for it, so that none is ever made under that key either (see ``_fresh_compile``).
FRESH_COMPILE = {"xla_dump_large_constants": True}
_persistent_cache_hits = 0  # in this process: a compile during which one happened is not stored
_counting_hits = False


def _count_hits(event: str, **_) -> None:
    global _persistent_cache_hits
    if event == "/jax/compilation_cache/cache_hits":
        _persistent_cache_hits += 1


def _start_counting_hits() -> None:
    """Listen to JAX's persistent-cache hits from now on: once per process, when the first engine
    builds its executable cache (importing this module registers nothing)."""
    global _counting_hits
    if not _counting_hits:
        jax.monitoring.register_event_listener(_count_hits)
        _counting_hits = True
        logger.info("counting JAX's persistent compilation cache hits (a listener on jax.monitoring)")


def cache_dir() -> Optional[Path]:
    """The directory of entries, or None when switched off (see the module's docstring)."""
    return envs.executable_cache_dir()


def max_bytes() -> int:
    """The folder's size bound: ``PAGED_JAX_EXECUTABLE_CACHE_MAX_MB`` megabytes, default 2048."""
    value = envs.executable_cache_max_mb()
    try:
        mb = float(value) if value.strip() else DEFAULT_MAX_MB
    except ValueError:
        logger.warning("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB=%r is not a number; using %d", value, DEFAULT_MAX_MB)
        mb = DEFAULT_MAX_MB
    return max(0, int(mb * (1 << 20)))


def prune(directory: Path, limit: int) -> int:
    """Delete the least recently used entries (oldest modification time first) of ``directory``
    until the rest add up to at most ``limit`` bytes; returns how many went. Files that another
    process deletes meanwhile are skipped."""
    entries = []
    for path in Path(directory).glob("*.jaxexe"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    removed = 0
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        total -= size
    return removed


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A hash of the Python source that traces into the step (any edit makes new keys)."""
    h = hashlib.sha256()
    for package in ("paged_jax", "pallas_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def native_identity() -> str:
    """The native kernels' library the step's FFI calls resolve to (its bytes' hash), or why none."""
    from paged_jax import native

    state = native.status()
    return _file_digest(state["library"]) if state.get("ok") else f"none: {state.get('error', 'not loaded')}"


def _abstract(tree) -> str:
    """A pytree's structure (static fields included) and each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr((str(treedef), [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]))


def runner_key(config, backend_name: str, params, kv_caches) -> str:
    """Everything but the shape that decides a runner's step program, as text."""
    devices = jax.devices()
    parts = {
        "format": FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": (devices[0].platform, devices[0].client.platform_version, devices[0].device_kind, len(devices)),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": jax.config.jax_enable_x64,
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "source": source_digest(),
        "native": native_identity(),
        "config": repr(config),
        "backend": backend_name,
        "params": _abstract(params),
        "kv_caches": _abstract(kv_caches),
    }
    return "\n".join(f"{k}={v}" for k, v in parts.items())


class ExecutableCache:
    """Compiled programs of one runner on disk: its steps, by ``(shape_key, all_logits)``, and the
    variants of the jitted functions it calls after them (the sampler), by abstract arguments."""

    def __init__(self, directory: Path, key: str, max_bytes: int = DEFAULT_MAX_MB << 20):
        self.directory, self.key, self.max_bytes = Path(directory), key, max_bytes
        self.loaded = self.stored = 0  # counts, for tests and benchmarks
        self.load_seconds = 0.0  # reading and loading entries, hits and misses

    def _entry(self, shape_key, all_logits: bool) -> tuple[Path, str]:
        return self._file("step", f"shape={tuple(shape_key)}\nall_logits={bool(all_logits)}")

    def _file(self, prefix: str, what: str) -> tuple[Path, str]:
        text = f"{self.key}\n{what}"
        return self.directory / f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.jaxexe", text

    def get(self, shape_key, all_logits: bool, lower: Callable[[], "jax.stages.Lowered"]) -> "jax.stages.Compiled":
        """The compiled step for this shape: loaded from disk, or ``lower().compile()`` and stored."""
        return self._get(*self._entry(shape_key, all_logits), lower)

    def get_function(self, name: str, args: tuple,
                     lower: Callable[[], "jax.stages.Lowered"]) -> "jax.stages.Compiled":
        """A jitted function of paged-jax's own (its code is in :func:`source_digest`), ``name``,
        compiled for the abstract values of ``args`` (tree structure with its static fields, shapes,
        dtypes, shardings): loaded from disk, or ``lower().compile()`` and stored."""
        return self._get(*self._file(name, f"function={name}\nargs={_abstract(args)}"), lower)

    def _get(self, path: Path, text: str, lower: Callable[[], "jax.stages.Lowered"]) -> "jax.stages.Compiled":
        t0 = time.perf_counter()
        compiled = self._load(path, text)
        self.load_seconds += time.perf_counter() - t0
        if compiled is None:
            compiled, fresh = _fresh_compile(lower())
            if fresh:
                self._store(path, text, compiled)
            else:
                logger.warning("compiled step %s came from JAX's persistent cache; not stored", path)
        return compiled

    def _load(self, path: Path, text: str):
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as e:
            logger.warning("unreadable compiled step %s, compiling it again: %s", path, e)
            return None
        if not isinstance(entry, dict) or entry.get("key") != text:
            logger.warning("compiled step %s was made for another key, compiling it again", path)
            return None
        try:
            # On the default device, as the step was compiled: left to itself, loading assigns the
            # program to every local device (a 4-device process then wants 4 shards of each input).
            compiled = serialize_executable.deserialize_and_load(entry["executable"], entry["in_tree"],
                                                                 entry["out_tree"],
                                                                 execution_devices=jax.devices()[:1])
        except Exception as e:
            logger.warning("compiled step %s did not load, compiling it again: %s", path, e)
            return None
        try:
            os.utime(path)  # recently used: pruned last
        except OSError:
            pass
        self.loaded += 1
        return compiled

    def _store(self, path: Path, text: str, compiled) -> None:
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump({"key": text, "executable": executable, "in_tree": in_tree, "out_tree": out_tree}, f)
                os.replace(tmp, path)  # atomic: a reader sees the old entry or the new one, never half
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self.stored += 1
        except Exception as e:  # a read-only disk, an executable this JAX cannot serialize: run without
            logger.warning("could not store compiled step %s: %s", path, e)
            return
        try:
            removed = prune(self.directory, self.max_bytes)
        except OSError as e:
            logger.warning("could not prune the compiled steps in %s: %s", self.directory, e)
            return
        if removed:
            logger.info("pruned %d least recently used compiled steps from %s", removed, self.directory)


def _fresh_compile(lowered) -> tuple["jax.stages.Compiled", bool]:
    """``lowered`` compiled by XLA, not read from JAX's persistent cache (see FRESH_COMPILE);
    and whether it was."""
    hits = _persistent_cache_hits
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))  # JAX writes nothing
    try:
        compiled = lowered.compile(compiler_options=FRESH_COMPILE)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    return compiled, _persistent_cache_hits == hits


def for_runner(config, backend, params, kv_caches, mesh=None, root=None) -> Optional[ExecutableCache]:
    """The cache for a runner's step, in the ``executables`` folder of ``root`` (an engine's
    ``compile_cache_dir``; None: :func:`cache_dir`), or None: switched off, tensor parallelism, or a
    backend that user code registered."""
    directory = cache_dir() if root is None else envs.executable_cache_dir(root)
    if directory is None or mesh is not None or not _builtin(backend):
        return None
    _start_counting_hits()
    return ExecutableCache(directory, runner_key(config, backend.name, params, kv_caches), max_bytes())


def _builtin(backend) -> bool:
    """Whether ``backend`` is one paged-jax defines (its code is in :func:`source_digest`)."""
    from pallas_kernels.backend import PALLAS, PALLAS_INTERPRET

    from paged_jax.attention.backends import NATIVE, REFERENCE

    return any(backend is b for b in (REFERENCE, NATIVE, PALLAS, PALLAS_INTERPRET))
