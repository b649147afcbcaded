"""Settings in one place: every PAGED_JAX_* environment variable is read in paged_jax/envs.py alone, each
is documented there and in the README's table, and the modules that use one follow it."""

from __future__ import annotations

import re
from pathlib import Path

from paged_jax import envs

ROOT = Path(__file__).resolve().parents[1]
READ = re.compile(r"""(?:environ(?:\.get)?\s*[\(\[]|getenv\s*\()\s*["'](PAGED_JAX_\w+)""")


def test_no_module_but_envs_reads_a_paged_jax_variable():
    readers = {}
    for path in [*(ROOT / "paged_jax").rglob("*.py"), *(ROOT / "pallas_kernels").rglob("*.py")]:
        if path.name == "envs.py":
            continue
        for name in READ.findall(path.read_text()):
            readers.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert readers == {}
    assert set(READ.findall('os.environ.get("PAGED_JAX_HOME") os.environ["PAGED_JAX_NATIVE"]')) == {
        "PAGED_JAX_HOME", "PAGED_JAX_NATIVE"}  # the pattern itself finds reads


def test_every_variable_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    for name, what in envs.VARIABLES.items():
        assert f"| `{name}` | {what} |" in readme, name


def test_the_modules_follow_the_variables(monkeypatch, tmp_path):
    from paged_jax import native
    from paged_jax.executor import executable_cache

    monkeypatch.setenv("PAGED_JAX_HOME", str(tmp_path / "home"))
    assert native.build._library_path().parent == tmp_path / "home" / "native"
    monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGED_JAX_NO_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("PAGED_JAX_NO_EXECUTABLE_CACHE", raising=False)
    assert executable_cache.cache_dir() == tmp_path / "cache" / "executables"
    monkeypatch.setenv("PAGED_JAX_NO_EXECUTABLE_CACHE", "1")
    assert executable_cache.cache_dir() is None and envs.compile_cache_dir() == tmp_path / "cache"
    monkeypatch.setenv("PAGED_JAX_NO_COMPILE_CACHE", "1")
    assert envs.compile_cache_dir() is None
    monkeypatch.setenv("PAGED_JAX_NATIVE", "0")
    assert not native.available()
    monkeypatch.setenv("PAGED_JAX_NATIVE_FLAGS", "-mno-avx512f -O2")
    assert native.build._flags()[-2:] == ["-mno-avx512f", "-O2"]


def test_importing_the_engine_changes_no_jax_setting_and_registers_no_listener():
    """JAX's settings and listeners change when an engine is built (and its log says so), never on import."""
    import subprocess
    import sys

    code = """
import jax, jax._src.monitoring as m
before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
          len(m._event_listeners))
import paged_jax.engine, paged_jax.llm, paged_jax.executor.model_runner, paged_jax.executor.executable_cache as ec
after = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
         len(m._event_listeners))
assert before == after and not ec._counting_hits, (before, after)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
