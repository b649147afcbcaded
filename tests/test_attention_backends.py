"""Choosing the attention backend: "auto" picks Pallas on a GPU and native on a CPU where they honour
the model, else the reference;
an explicit backend that cannot honour the model's spec raises at start; and a model whose config has
a sliding window and a soft-cap runs them in every backend (reference, Pallas and native agree)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pytest

from paged_jax import native
from paged_jax.attention import NATIVE, REFERENCE, AttentionSpec, select_backend

PLAIN = AttentionSpec(0.25)
WINDOWED = AttentionSpec(0.25, sliding_window=6, logit_soft_cap=5.0)


@pytest.mark.skipif(not native.available(), reason=f"native kernel not built: {native.status()}")
def test_auto_picks_native_where_it_honours_the_model():
    assert select_backend("auto", [PLAIN], "float32") is NATIVE
    assert select_backend("auto", [PLAIN], "bfloat16") is NATIVE
    assert select_backend("auto", [PLAIN], "float16") is REFERENCE  # the kernel has no float16 variant
    assert select_backend("auto", [PLAIN, WINDOWED], "float32") is NATIVE  # window and soft-cap: kernel arguments


def test_auto_without_native_kernels_is_the_reference(monkeypatch):
    monkeypatch.setenv("PAGED_JAX_NATIVE", "0")
    assert select_backend("auto", [PLAIN], "float32") is REFERENCE
    with pytest.raises(ValueError, match="'native' cannot run this model: the native library is not available"):
        select_backend("native", [PLAIN], "float32")
    with pytest.raises(ValueError, match="attention_backend must be 'auto' or one of .*'native'.*got 'nativ'"):
        select_backend("nativ", [PLAIN], "float32")


def test_auto_on_a_gpu_picks_pallas_and_never_builds_the_native_library(monkeypatch):
    """JAX's default backend read as "gpu": "auto" runs the Pallas kernels, whatever the spec or the
    dtype they honour, and asks nothing of the native CPU library (never built on a GPU host)."""
    import jax

    from pallas_kernels.backend import PALLAS

    def no_build():
        raise AssertionError("the native library was asked for on a GPU host")

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(native, "available", no_build)
    assert select_backend("auto", [PLAIN, WINDOWED], "float32") is PALLAS
    assert select_backend("auto", [PLAIN], "float16") is PALLAS
    assert select_backend("auto", [PLAIN], "fp8") is PALLAS
    assert select_backend("auto", [PLAIN], "float64") is REFERENCE  # no kernel of Pallas' takes it
    with pytest.raises(ValueError, match="'native' cannot run this model: it runs on a CPU, and JAX's default "
                                         "backend is 'gpu'"):
        select_backend("native", [PLAIN], "float32")


def test_auto_on_a_platform_without_kernels_is_the_reference(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert select_backend("auto", [PLAIN], "float32") is REFERENCE


@dataclasses.dataclass(frozen=True)
class SpecWithSinks(AttentionSpec):
    """A field no backend declares yet (as attention sinks would be, before a kernel honours them)."""

    sink_logit: Optional[float] = None


class UndeclaredBackend:
    """A user's backend that declares nothing: it honours the scale alone."""

    name = "test-undeclared"

    def check(self, spec, dtype):
        pass

    def decode(self, q, k_cache, v_cache, meta, spec):
        raise NotImplementedError

    def prefill(self, q, k_cache, v_cache, meta, spec):
        raise NotImplementedError


def test_a_spec_field_a_backend_has_not_declared_is_refused_by_name(monkeypatch):
    """Selection reads each backend's declarations: a non-default field it has not declared is
    refused with the field named, whatever its check says; "auto" falls back to the reference
    only where the reference declares the field, and raises where no backend does."""
    from paged_jax.attention import backends
    from paged_jax.attention.spec import non_default_fields

    assert non_default_fields(PLAIN) == () and non_default_fields(WINDOWED) == ("sliding_window", "logit_soft_cap")
    sinks = SpecWithSinks(0.25, sink_logit=1.5)
    assert non_default_fields(sinks) == ("sink_logit",)
    for name in ("native", "pallas-interpret", "reference"):
        with pytest.raises(ValueError, match=f"attention_backend='{name}' does not honour the model's attention "
                                             "sink_logit=1.5"):
            select_backend(name, [PLAIN, sinks], "float32")
    with pytest.raises(ValueError, match="sink_logit=1.5"):
        select_backend("auto", [sinks], "float32")
    assert select_backend("auto", [SpecWithSinks(0.25)], "float32") in (NATIVE, REFERENCE)  # default: no change

    monkeypatch.setitem(backends._BACKENDS, UndeclaredBackend.name, UndeclaredBackend())
    assert select_backend("test-undeclared", [PLAIN], "float16").name == "test-undeclared"
    with pytest.raises(ValueError, match=r"'test-undeclared' does not honour the model's attention sliding_window=6 "
                                         r"\(it declares no field beyond the scale\)"):
        select_backend("test-undeclared", [WINDOWED], "float32")
    with pytest.raises(ValueError, match="'native' takes caches of dtype float32 / bfloat16 / int8 / fp8, got 'float16'"):
        select_backend("native", [PLAIN], "float16")


def test_a_windowed_soft_capped_model_pallas_and_native_match_reference(tiny_llama_dir):
    """The spec comes from the model config: the reference's hooks and the Pallas and native kernels'
    arguments agree on prefill and decode steps, and the variant changes the logits."""
    from paged_jax.executor.batch import SeqChunk
    from paged_jax.models.loader import load_model
    from tests.model_helpers import PagedRunner

    config, params = load_model(tiny_llama_dir, dtype="float32")
    windowed = dataclasses.replace(config, sliding_window=5, attn_logit_softcap=2.0)
    kinds = [("plain", config, "reference"), ("reference", windowed, "reference"), ("pallas", windowed, "pallas-interpret")]
    if native.available():
        kinds.append(("native", windowed, "native"))
    runners = {name: PagedRunner(cfg, params, block_size=4, num_blocks=32, seed=3, backend=backend)
               for name, cfg, backend in kinds}
    prompts = [[5, 9, 200, 31, 7, 77, 8, 19, 4, 11], [42], [3, 4, 5, 6, 7, 8, 9]]
    tables = {name: [r.table_for([], len(p)) for p in prompts] for name, r in runners.items()}
    seqs = [list(p) for p in prompts]
    chunks = {name: [SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables[name])] for name in runners}
    for step in range(4):  # a prefill step, then decode steps past the window
        logits = {}
        for name, r in runners.items():
            out, batch = r.run(chunks[name])
            logits[name] = out[batch.last_token[: batch.num_seqs]]
        np.testing.assert_allclose(logits["pallas"], logits["reference"], atol=1e-4, rtol=0)
        if "native" in logits:
            np.testing.assert_allclose(logits["native"], logits["reference"], atol=1e-4, rtol=0)
        assert not np.allclose(logits["plain"][0], logits["reference"][0], atol=1e-3), "the variant must matter"
        for s, tok in zip(seqs, logits["reference"].argmax(-1)):
            s.append(int(tok))
        chunks = {name: [SeqChunk([s[-1]], len(s) - 1, runners[name].table_for(t, len(s)))
                         for s, t in zip(seqs, tables[name])] for name in runners}


def test_pallas_backends_import_without_the_attention_package():
    """No import cycle: pallas_kernels.backend stands alone; paged_jax.attention imports it, not the reverse."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    code = ("import sys, pallas_kernels.backend as b; "
            "assert not any(m.startswith('paged_jax.attention') for m in sys.modules), sorted(sys.modules); "
            "import paged_jax.attention as a; assert a.get_backend('pallas') is b.PALLAS")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root,
                   env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"})
