"""The RMS norm in one native operation (paged_jax/native/rms_norm.cc): against a float64 numpy
oracle, as one operation in the compiled step, and where the engine uses it (the native kernels on
one CPU device) or not (native_kernels=False)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams, native
from paged_jax.models.layers import rms_norm
from tests.native_paths import native_paths_report  # noqa: F401 (autouse: the paths report)

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")


def oracle(x, w, eps):
    x = x.astype(np.float64)
    return w.astype(np.float64) * x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


@needs_native
@pytest.mark.parametrize("shape", [(1, 512), (3, 37), (200, 96), (5, 4, 64)],
                         ids=["one row", "width not a multiple of 16", "rows over threads", "per head"])
def test_native_rms_norm_matches_numpy(shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 10, shape[:-1] + (1,))).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    x[0] = 0  # a row of zeros: eps alone under the root, the output zeros
    for eps in (1e-6, 0.5):  # a large eps visibly changes every row
        got = np.asarray(jax.jit(lambda x, w: rms_norm(x, w, eps, native_norm=True))(x, w))
        want = oracle(x, w, eps)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
        assert not got[0].any()


@needs_native
def test_the_native_norm_is_one_operation_and_xla_s_is_several():
    x, w = jnp.ones((4, 512), jnp.float32), jnp.ones((512,), jnp.float32)

    def ops(native_norm):
        hlo = jax.jit(lambda x, w: rms_norm(x, w, 1e-6, native_norm)).lower(x, w).compile().as_text()
        entry = hlo[hlo.index("ENTRY"):]
        return entry.count("custom-call("), entry.count("fusion(") + entry.count("reduce")

    assert ops(True) == (1, 0)
    calls, xla_ops = ops(False)
    assert calls == 0 and xla_ops >= 2
    # not for other dtypes: XLA's norm in bfloat16
    assert not native.rms_norm_applies(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match="float32 x"):
        native.rms_norm(x.astype(jnp.bfloat16), w, 1e-6)


@needs_native
def test_the_engine_norms_natively_with_the_native_kernels_only(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["def add(a, b):", "import os"]
    on = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64)
    off = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64, native_kernels=False)
    assert on.llm_engine.runner.config.native_norm and not off.llm_engine.runner.config.native_norm
    native.build._traced.discard("rms norm float32")  # said again only if this engine's step puts it in
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert "rms norm float32" in native.status()["traced"]
    assert got == [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
