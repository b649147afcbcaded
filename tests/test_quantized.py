"""int8 weights quantized on load (``quantization="int8"``): per output channel, symmetric.

Oracles: numpy for the quantizer and the matmul; the float model for the engine (logits within the
error the quantization itself makes, greedy tokens equal on the trained default model, whose
choices are not knife-edge); tensor parallelism against one device."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.models.weights import DenseLinear, Int8Linear, quantize_int8


def test_quantize_int8_is_per_column_symmetric_and_its_matmul_is_the_dequantized_one():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 20)).astype(np.float32) * rng.uniform(0.01, 3, size=20).astype(np.float32)
    w[:, 3] = 0  # an all-zero column
    b = rng.standard_normal(20).astype(np.float32)
    p = quantize_int8(DenseLinear(jnp.asarray(w), jnp.asarray(b), "column"))
    assert isinstance(p, Int8Linear) and p.q.dtype == jnp.int8 and p.parallel == "column"
    scale = np.abs(w).max(axis=0) / 127
    np.testing.assert_allclose(np.asarray(p.scale)[scale > 0], scale[scale > 0], rtol=1e-6)
    q = np.asarray(p.q).astype(np.float32)
    assert np.abs(q).max() == 127 and not q[:, 3].any()
    assert (np.abs(q * np.asarray(p.scale) - w) <= scale * 0.5 * (1 + 1e-5) + 1e-9).all()  # half a step
    x = rng.standard_normal((5, 48)).astype(np.float32)
    want = x @ (q * np.asarray(p.scale)) + b
    np.testing.assert_allclose(np.asarray(p(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


def _run(model, quantization, prompts, tp=1, **kw):
    llm = LLM(model, quantization=quantization, max_model_len=256, tensor_parallel_size=tp, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs]


def test_int8_on_load_holds_int8_layers_and_keeps_the_default_models_greedy_tokens():
    prompts = ["def __init__(self, ", "import os\nimport sys\n", "    def close(self):\n"]
    _, want, want_lps = _run(None, None, prompts)
    llm, got, got_lps = _run(None, "int8", prompts)
    params = llm.llm_engine.runner.params
    linears = [v for lp in params["layers"] for v in lp.values() if hasattr(v, "__call__")]
    assert linears and all(isinstance(v, Int8Linear) for v in linears)
    assert got == want
    # The chosen tokens' logprobs move by about what an int8 rounding of every layer moves them.
    diffs = [abs(g[t] - w[t]) for gs, ws, ts in zip(got_lps, want_lps, want) for g, w, t in zip(gs, ws, ts)]
    assert 0 < max(diffs) < 0.05


def test_quantization_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"quantization must be None or one of \['int8'\], got 'int4'"):
        LLM(quantization="int4")


@pytest.mark.slow
def test_int8_under_tensor_parallelism_matches_one_device():
    import subprocess
    import sys

    code = ("import json; from tests.test_quantized import _run; "
            "_, a, _ = _run(None, 'int8', ['def f(x):', 'class A:'], tp=1); "
            "_, b, _ = _run(None, 'int8', ['def f(x):', 'class A:'], tp=2); print(json.dumps(a == b))")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PAGED_JAX_NATIVE": "0"}
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "true"
