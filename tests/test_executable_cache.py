"""The on-disk cache of compiled steps (``paged_jax.executor.executable_cache``): a second process
loads them and traces nothing, with the same tokens; an entry made for another key is never loaded;
a corrupt entry is compiled again with a warning; the folder is kept under its size bound, least
recently used entries first; the switches turn it off."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
from collections import Counter
import jax, jax.monitoring

events = Counter()
def listen(event, seconds, fun_name="", **_):
    if event.startswith("/jax/core/compile/"):
        name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name
        events["step" if name == "step" else "sampler" if name in ("sample", "_take_rows") else "other"] += 1
jax.monitoring.register_event_duration_secs_listener(listen)

from paged_jax import LLM, SamplingParams, native

llm = LLM(sys.argv[1], seed=0, num_kv_blocks=32, block_size=8, max_num_seqs=4)
runner = llm.llm_engine.runner
before = jax.tree.leaves(runner.kv_caches)
# A greedy request (its tokens from the step itself) and a seeded one (through the sampler).
outs = llm.generate(prompt_token_ids=[[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]],
                    sampling_params=[SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                     SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True)],
                    use_tqdm=False)
cache = runner.executable_cache
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "native": native.available(),
                  "on": cache is not None, "loaded": cache.loaded if cache else 0,
                  "stored": cache.stored if cache else 0, "step_events": events["step"],
                  "sampler_events": events["sampler"],
                  "donated": all(x.is_deleted() for x in before)}))
"""


def _start(model, cache: Path, **env):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PAGED_JAX_NO_")},
           "PAGED_JAX_COMPILE_CACHE": str(cache), "JAX_PLATFORMS": "cpu", **env}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# 30 s (a second interpreter compiles nothing): -m slow; the tests above load, key and evict entries in this one
@pytest.mark.slow
def test_second_process_loads_the_steps_and_traces_none(tiny_llama_dir, tmp_path):
    from paged_jax import native

    cache = tmp_path / "cache"
    off = _start(tiny_llama_dir, cache, PAGED_JAX_NO_EXECUTABLE_CACHE="1")  # the plain jit path
    assert not off["on"] and not (cache / "executables").exists()
    cold = _start(tiny_llama_dir, cache)
    assert cold["on"] and cold["stored"] > 0 and cold["loaded"] == 0 and cold["step_events"] > 0
    warm = _start(tiny_llama_dir, cache)
    assert warm["loaded"] == cold["stored"] and warm["stored"] == 0
    assert warm["step_events"] == 0  # neither traced, lowered nor compiled
    assert cold["sampler_events"] > 0 and warm["sampler_events"] == 0  # the sampler's variants neither
    assert warm["tokens"] == cold["tokens"] == off["tokens"]
    # The KV cache was donated through the loaded programs (updated in place), which held the
    # native kernels' FFI calls where this machine has them.
    assert warm["donated"] and cold["donated"]
    assert warm["native"] == native.available()


@pytest.mark.slow  # 10 s; the default set's second-process test covers the cache's loading
def test_a_process_with_several_devices_loads_single_device_steps(tiny_llama_dir, tmp_path):
    """A tensor-parallel size of 1 in a process that sees several devices: the loaded program runs
    on the default device, as it was compiled (left to itself it wanted a shard per device)."""
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    cold = _start(tiny_llama_dir, tmp_path / "cache", **flags)
    warm = _start(tiny_llama_dir, tmp_path / "cache", **flags)
    assert cold["stored"] > 0 and warm["loaded"] == cold["stored"] and warm["tokens"] == cold["tokens"]


# ---- in one process: keys, corrupt entries, switches ----------------------------------------
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    from paged_jax.executor import executable_cache

    monkeypatch.delenv("PAGED_JAX_NO_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("PAGED_JAX_NO_EXECUTABLE_CACHE", raising=False)
    monkeypatch.delenv("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB", raising=False)
    monkeypatch.setattr(executable_cache, "cache_dir", lambda: tmp_path / "executables")
    return tmp_path / "executables"


SHAPE = (2, 2, 4, 0)  # a decode step of two sequences


def _runner(model, **kw):
    from paged_jax import LLM

    args = dict(seed=0, num_kv_blocks=16, block_size=8, max_num_seqs=2, swap_space=0)
    return LLM(str(model), **{**args, **kw}).llm_engine.runner


def _compile(runner, shape=SHAPE):
    """The runner's step for ``shape``, through the cache; returns how many entries it loaded."""
    from paged_jax.executor.batch import Batch

    cache = runner.executable_cache
    before = cache.loaded
    runner._compile(Batch.abstract(shape), False)
    return cache.loaded - before


def test_a_changed_key_never_loads_another_entry(tiny_llama_dir, cache_dir, monkeypatch):
    import jax

    from paged_jax.executor import executable_cache

    assert _compile(_runner(tiny_llama_dir)) == 0  # stored
    assert len(list(cache_dir.glob("*.jaxexe"))) == 1
    assert _compile(_runner(tiny_llama_dir)) == 1  # the same key loads it
    assert _compile(_runner(tiny_llama_dir, block_size=16)) == 0  # other KV cache shapes
    assert _compile(_runner(tiny_llama_dir, dtype="bfloat16")) == 0
    assert _compile(_runner(tiny_llama_dir, kv_cache_dtype="int8")) == 0
    with monkeypatch.context() as m:
        m.setattr(executable_cache, "native_identity", lambda: "another build of the native kernels")
        assert _compile(_runner(tiny_llama_dir)) == 0
    with monkeypatch.context() as m:
        m.setattr(jax, "__version__", "0.0.1")
        assert _compile(_runner(tiny_llama_dir)) == 0
    assert len(list(cache_dir.glob("*.jaxexe"))) == 6
    assert _compile(_runner(tiny_llama_dir)) == 1  # the first entry is still there and still loads


def test_an_entry_under_another_name_is_not_loaded(tiny_llama_dir, cache_dir, caplog):
    """A file whose stored key differs from the one its name stands for (a hash collision, a copied
    file) is compiled again, and replaced."""
    _compile(_runner(tiny_llama_dir, block_size=16))
    (made,) = cache_dir.glob("*.jaxexe")
    runner = _runner(tiny_llama_dir)
    path, _ = runner.executable_cache._entry(SHAPE, False)
    shutil.copy(made, path)
    with caplog.at_level(logging.WARNING, logger="paged_jax"):
        assert _compile(runner) == 0
    assert "another key" in caplog.text
    assert _compile(_runner(tiny_llama_dir)) == 1  # overwritten with the right one


def test_a_corrupt_entry_compiles_again_with_a_warning(tiny_llama_dir, cache_dir, caplog):
    runner = _runner(tiny_llama_dir)
    _compile(runner)
    (path,) = cache_dir.glob("*.jaxexe")
    path.write_bytes(path.read_bytes()[:1000])  # a half-written file
    with caplog.at_level(logging.WARNING, logger="paged_jax"):
        assert _compile(_runner(tiny_llama_dir)) == 0
    assert "unreadable compiled step" in caplog.text
    assert _compile(_runner(tiny_llama_dir)) == 1  # overwritten, loads again


def test_the_least_recently_used_entries_go_past_the_size_bound(tiny_llama_dir, cache_dir, monkeypatch):
    """Storing an entry prunes the folder to PAGED_JAX_EXECUTABLE_CACHE_MAX_MB, least recently used
    first; loading an entry makes it recently used."""
    monkeypatch.setenv("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB", "15")
    assert _compile(_runner(tiny_llama_dir)) == 0  # stored
    (used,) = cache_dir.glob("*.jaxexe")
    now = time.time()
    os.utime(used, (now - 1000, now - 1000))  # stored long ago...
    old = []
    for i, age in enumerate((300, 200)):  # two stale entries of 10 MB (sparse files), the first the older
        path = cache_dir / f"step-stale{i}.jaxexe"
        with open(path, "wb") as f:
            f.truncate(10 << 20)
        os.utime(path, (now - age, now - age))
        old.append(path)
    assert _compile(_runner(tiny_llama_dir)) == 1  # ...and loaded now: the most recently used
    assert used.exists() and all(p.exists() for p in old)  # loading stores nothing, so prunes nothing
    assert _compile(_runner(tiny_llama_dir), (1, 1, 4, 0)) == 0  # stored: 20 MB and two steps, over 15 MB
    assert not old[0].exists()  # the least recently used went...
    assert used.exists() and old[1].exists()  # ...and that was enough:
    (made,) = set(cache_dir.glob("*.jaxexe")) - {used, *old}
    assert used.stat().st_size + made.stat().st_size < 5 << 20  # the steps fit beside one stale entry
    assert _compile(_runner(tiny_llama_dir)) == 1


def test_the_size_bound_setting(monkeypatch):
    from paged_jax.executor import executable_cache

    monkeypatch.delenv("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB", raising=False)
    assert executable_cache.max_bytes() == 2048 << 20
    monkeypatch.setenv("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB", "0.5")
    assert executable_cache.max_bytes() == 512 << 10
    monkeypatch.setenv("PAGED_JAX_EXECUTABLE_CACHE_MAX_MB", "lots")
    assert executable_cache.max_bytes() == 2048 << 20


@pytest.mark.parametrize("switch", ["PAGED_JAX_NO_EXECUTABLE_CACHE", "PAGED_JAX_NO_COMPILE_CACHE"])
def test_switches_turn_it_off(tiny_llama_dir, tmp_path, monkeypatch, switch):
    from paged_jax.executor import executable_cache

    session_cache = os.environ.get("PAGED_JAX_COMPILE_CACHE")
    monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGED_JAX_NO_COMPILE_CACHE", raising=False)
    assert executable_cache.cache_dir() == tmp_path / "executables"
    monkeypatch.setenv(switch, "1")
    assert executable_cache.cache_dir() is None
    # JAX's own cache stays where the session has it (tests/conftest.py: a temporary directory)
    if session_cache is None:
        monkeypatch.delenv("PAGED_JAX_COMPILE_CACHE")
    else:
        monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE", session_cache)
    assert _runner(tiny_llama_dir).executable_cache is None


def test_user_registered_backends_are_not_cached(tiny_llama_dir, cache_dir):
    """Their Python hooks are not in the key (only paged-jax's own source is)."""
    from paged_jax.attention import ReferenceBackend, register_backend

    register_backend(ReferenceBackend("test-executable-cache-user-backend"))
    runner = _runner(tiny_llama_dir, attention_backend="test-executable-cache-user-backend")
    assert runner.executable_cache is None
