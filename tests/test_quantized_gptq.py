"""GPTQ, AWQ and vLLM-fp8 checkpoints, against the quantizer's own load-back.

The fixtures (tests/fixtures/quantized/) were made once by experiments/make_quantized_fixtures.py
in an environment of their own: GPTQ and AWQ by GPTQModel 7.6.0, each folder with GPTQModel's
load-back of it (``oracle.npz``: greedy tokens, teacher-forced logprobs, the float weight its torch
kernel dequantizes one module to); vLLM's fp8 folders written in the documented layout, with
transformers' fp8 loading as the oracle. Nothing here re-implements a format: the engine's numbers
are compared with the library's.

Tolerances: the dequantized weights are equal (both sides compute ``(q - z) * s`` or ``fp8 * s``
once in float32). Teacher-forced logprobs agree within 1e-4: both run the same float32 weights
through two layers with a different summation order, which moves logprobs by a few 1e-6 (seen: at
most 7e-6). AWQ's own torch kernel computes in float16 whatever its input; against it the logprobs
agree within 2e-2 (seen: at most 7e-3; each float16 matmul output carries a relative error up to
2^-11 and the tiny model's logits span tens of units).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.errors import ModelLoadError
from paged_jax.models.loader import load_model
from paged_jax.weights import PanelQuantizedLinear, QuantizedLinear
from paged_jax.weights.fused import unfused
from tests.host_devices import xla_flags_with_devices

FIXTURES = Path(__file__).parent / "fixtures" / "quantized"
PROMPTS = [[1, 5, 9, 33, 77, 100, 200], [1, 40, 41, 42], [1, 300, 301, 302, 303, 304, 305, 306, 307]]
ORACLE_MODULE = "model.layers.0.mlp.down_proj"
# name -> (values dtype, bits, zero points kept, g_idx kept)
EXPECTED = {
    "gptq-llama-w4g128-act": (jnp.uint8, 4, True, True),  # activation order: down_proj's rows permuted
    "gptq-qwen2-w8ch": (jnp.int8, 8, False, False),  # symmetric: the zeros are all the midpoint
    "gptq-llama-w4g64-v2": (jnp.uint8, 4, True, False),
    "awq-llama-w4g128": (jnp.uint8, 4, True, False),
    "awq-qwen2-w4g64": (jnp.uint8, 4, False, False),  # zero_point false: qzeros all 8
    "fp8-llama-block64": (jnp.float8_e4m3fn, 8, False, False),
    "fp8-qwen2-tensor": (jnp.float8_e4m3fn, 8, False, False),
}
# the end-to-end engine runs in the default suite for these; the rest with -m slow
FAST = ("gptq-llama-w4g128-act", "gptq-qwen2-w8ch", "awq-llama-w4g128", "fp8-llama-block64")


def oracle(name):
    return np.load(FIXTURES / name / "oracle.npz")


def oracle_tokens(o):
    return [o[f"tokens_{i}"].tolist() for i in range(len(PROMPTS))]


def engine_run(path, **kw):
    """Greedy continuations of PROMPTS and, in the same batch, the teacher-forced logprobs of
    each prompt followed by the oracle's continuation."""
    o = oracle(Path(path).name)
    llm = LLM(str(path), dtype="float32", max_model_len=128, **kw)
    forced = [p + t for p, t in zip(PROMPTS, oracle_tokens(o))]
    greedy = SamplingParams(temperature=0, max_tokens=len(o["tokens_0"]), ignore_eos=True)
    teacher = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompt_token_ids=PROMPTS + forced, use_tqdm=False,
                        sampling_params=[greedy] * len(PROMPTS) + [teacher] * len(forced))
    tokens = [list(out.outputs[0].token_ids) for out in outs[:len(PROMPTS)]]
    logprobs = [np.array([d[t] for d, t in zip(out.prompt_logprobs[1:], seq[1:])])
                for out, seq in zip(outs[len(PROMPTS):], forced)]
    return llm, tokens, logprobs


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dequantized_weight_equals_the_quantizers_own(name):
    _, params = load_model(FIXTURES / name, dtype="float32")
    linears = [v for lp in params["layers"] for v in lp.values() if hasattr(v, "__call__")]
    dtype, bits, has_zero, has_g_idx = EXPECTED[name]
    assert linears and all(isinstance(v, QuantizedLinear) and v.values.dtype == dtype and v.bits == bits
                           for v in linears)  # held quantized, not dequantized on load
    down = params["layers"][0]["down"]
    assert (down.zero is not None, down.g_idx is not None) == (has_zero, has_g_idx)
    np.testing.assert_allclose(np.asarray(down.dequantize()), oracle(name)[ORACLE_MODULE], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(EXPECTED)])
def test_greedy_tokens_and_logprobs_equal_the_quantizers_load_back(name):
    o = oracle(name)
    _, tokens, logprobs = engine_run(FIXTURES / name)
    assert tokens == oracle_tokens(o)
    for i, got in enumerate(logprobs):
        np.testing.assert_allclose(got, o[f"logprobs_{i}"], rtol=0, atol=1e-4)
        if f"fp16_kernel_logprobs_{i}" in o:  # AWQ's own float16 kernel, unpatched
            np.testing.assert_allclose(got, o[f"fp16_kernel_logprobs_{i}"], rtol=0, atol=2e-2)
            assert tokens[i] == o[f"fp16_kernel_tokens_{i}"].tolist()


def test_gptq_v1_zeros_of_zero_borrowed_from_their_neighbour_and_are_restored_exactly():
    """GPTQModel writes v1 zeros by subtracting 0x11111111 from each packed word, so a zero of 0
    borrows from the next nibble; adding one to each nibble on read (not to the word) would give
    16 and one less for its neighbour. The oracle: GPTQModel's own v2 -> v1 conversion and its
    dequantization of the zeros before it."""
    from paged_jax.weights.methods.gptq import GPTQQuantization

    o = np.load(FIXTURES / "gptq-v1-zero-borrow.npz")
    n_in, n_out = o["g_idx"].shape[0], o["scales"].shape[1]
    gptq = GPTQQuantization.from_config({"bits": 4, "group_size": 64, "checkpoint_format": "gptq"}, "test")
    tensors = {"m.qweight": o["qweight"], "m.qzeros": o["v1_qzeros"], "m.scales": o["scales"], "m.g_idx": o["g_idx"]}
    got = gptq.linear("m", tensors, n_out, n_in, None, None).dequantize()
    np.testing.assert_allclose(np.asarray(got), o["dequantized"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["gptq-qwen2-w8ch", "gptq-llama-w4g128-act", "awq-llama-w4g128", "fp8-llama-block64"])
def test_native_cpu_matmul_takes_gptq_awq_and_fp8_with_zero_points_activation_order_and_blocks(name):
    """Symmetric, asymmetric with activation order, AWQ with zero points, fp8 in 64 x 64 blocks:
    every linear is packed for the native matmul (and the greedy test above runs them through it)."""
    from paged_jax import native

    llm = LLM(str(FIXTURES / name), dtype="float32", max_model_len=128)
    linears = [v for lp in llm.llm_engine.runner.params["layers"] for v in unfused(lp).values() if hasattr(v, "__call__")]
    assert all(isinstance(v, PanelQuantizedLinear) for v in linears) == native.available()
    _, _, has_zero, has_g_idx = EXPECTED[name]
    if native.available():
        assert all((v.zeros is not None) == has_zero for v in linears)
        assert any(v.order is not None for v in linears) == has_g_idx


def test_gptq_checkpoint_survives_preemption():
    name = "gptq-llama-w4g128-act"
    want = oracle_tokens(oracle(name)) * 2
    for mode in ("swap", "recompute"):
        llm = LLM(str(FIXTURES / name), dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=16,
                  preemption_mode=mode)
        outs = llm.generate(prompt_token_ids=PROMPTS * 2, use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=len(want[0]), ignore_eos=True))
        assert [list(out.outputs[0].token_ids) for out in outs] == want
        assert llm.llm_engine.scheduler.num_preemptions[mode] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptq-llama-w4g128-act", "awq-qwen2-w4g64", "fp8-llama-block64"])
def test_under_tensor_parallelism_tokens_equal_the_quantizers(name):
    code = (f"import json; from tests.test_quantized_gptq import engine_run, FIXTURES; "
            f"_, t, _ = engine_run(FIXTURES / {name!r}, tensor_parallel_size=2); print(json.dumps(t))")
    env = {**os.environ, "XLA_FLAGS": xla_flags_with_devices(2), "PAGED_JAX_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == oracle_tokens(oracle(name))


# --- refusals, before any weight is read -----------------------------------------------------------

def _write_config(tmp_path, qc):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100, "quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights: a refusal must come first
    return tmp_path


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"},
     r"quant_method 'bitsandbytes' is not supported; supported: \['compressed-tensors', 'gptq', 'awq', 'fp8'\]"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"gptq with bits=3 is not supported; supported: \['bits 4', 'bits 8'\]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"gptq checkpoint_format 'marlin' is not supported; supported: \['gptq', 'gptq_v2'\]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"gptq group_size 0 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down.*": {}}},
     r"gptq per-module overrides \('dynamic'\) is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"},
     r"awq with bits=8 is not supported; supported: \['bits 4'\]"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"awq version 'gemv' is not supported; supported: \['gemm'\]"),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     r"fp8 activation_scheme 'static' \(static input scales\) is not supported; supported: \['dynamic'\]"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}, r"fp8 fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]},
     r"fp8 weight_block_size \[128\] is not supported"),
    # GPTQModel's own fp8 divides by its weight_scale_inv: not vLLM's layout, whatever its quant_method says
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_scale_method": "row",
      "weight_scale_semantics": "inverse"}, r"fp8 weight_scale_semantics 'inverse' .* is not supported"),
])
def test_unsupported_quantization_is_refused_before_any_weight_is_read(tmp_path, qc, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(_write_config(tmp_path, qc)))


def _copy_with_config(tmp_path, name, **changes):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("name, changes, tensor, shape, implied", [
    # groups of 64 would need twice the zero points the checkpoint has (q_proj's input is 128)
    ("gptq-llama-w4g128-act", dict(group_size=64), "q_proj.qzeros", (1, 16), (2, 16)),
    ("gptq-qwen2-w8ch", dict(bits=4), "q_proj.qweight", (32, 128), (16, 128)),
    ("awq-llama-w4g128", dict(group_size=32), "q_proj.qzeros", (1, 16), (4, 16)),
    ("fp8-llama-block64", dict(weight_block_size=[32, 32]), "q_proj.weight_scale_inv", (2, 2), (4, 4)),
])
def test_a_tensor_whose_shape_the_config_contradicts_is_named(tmp_path, name, changes, tensor, shape, implied):
    folder = _copy_with_config(tmp_path, name, **changes)
    with pytest.raises(ModelLoadError) as e:
        load_model(folder, dtype="float32")
    assert f"tensor 'model.layers.0.self_attn.{tensor}' has shape {shape}, config implies {implied}" in str(e.value)
