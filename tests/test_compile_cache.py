"""JAX's persistent compilation cache: a second start of the same model loads its step programs
(native decode kernel included) from disk instead of compiling them, and generates the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
import jax
from jax import monitoring

counts = {"hits": 0, "misses": 0}
def listen(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        counts["misses"] += 1
monitoring.register_event_listener(listen)

from paged_jax import LLM, SamplingParams
from paged_jax import native

llm = LLM(sys.argv[1], seed=0)
outs = llm.generate(prompt_token_ids=[[5, 6, 7], [9, 10, 11, 12, 13, 14]],
                    sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "native": native.available(), **counts}))
"""


@pytest.mark.slow  # 10 s; the executable cache (test_executable_cache.py) is what a second start loads first
def test_second_start_loads_programs_from_the_cache(tiny_llama_dir, tmp_path):
    # JAX's cache alone: compiled steps on disk (tests/test_executable_cache.py) would skip it.
    env = dict(os.environ, PAGED_JAX_COMPILE_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
               PAGED_JAX_NO_EXECUTABLE_CACHE="1")
    env.pop("PAGED_JAX_NO_COMPILE_CACHE", None)

    def start():
        res = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_dir)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["misses"] > 0 and first["hits"] == 0
    assert second["hits"] >= first["misses"] and second["misses"] == 0
    assert second["tokens"] == first["tokens"]
    from paged_jax import native

    assert first["native"] == second["native"] == native.available()  # the programs held the native kernel
