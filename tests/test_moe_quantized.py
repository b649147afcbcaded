"""Quantized mixture-of-experts checkpoints: compressed-tensors W4A16 (pack-quantized int4, scales per
group) on every expert, as llm-compressor writes a quantized MoE.

transformers 5 keeps a mixture's experts as fused 3-D parameters, which compressed-tensors (it quantizes
``Linear`` modules) cannot target in the model; but the checkpoint stores each expert's projections as
separate ``[out, in]`` tensors, so the fixture quantizes those with compressed-tensors itself: each
expert tensor becomes an ``nn.Linear`` of its checkpoint name, quantized and compressed by the library,
and written back beside the float attention, router and embeddings. The oracle is the library's own
decompression of that folder (its decompressors), loaded as a float model by transformers.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

EXPERT = re.compile(r".*\.experts\.\d+\.\w+\.weight$")
GROUP = 16  # the tiny experts are 48 wide: groups of 16 divide every expert's inputs


def quantize_experts(src: Path, out: Path, scheme: str = "W4A16") -> Path:
    """The float folder ``src`` with every expert projection quantized and compressed by compressed-tensors."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from safetensors.torch import load_file, save_file

    from tests.hf_models import _set_weight_qparams

    state = load_file(str(src / "model.safetensors"))
    experts = torch.nn.Module()
    for name, w in state.items():
        if EXPERT.match(name):
            parent = experts
            *path, leaf, _ = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight.data.copy_(w)
            parent.add_module(leaf, linear)
    qs = preset_name_to_scheme(scheme, ["Linear"])
    qs.weights.group_size = GROUP
    apply_quantization_config(experts, QuantizationConfig(config_groups={"group_0": qs}, ignore=["lm_head"]))
    for m in experts.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            _set_weight_qparams(m)
    compressor = ModelCompressor.from_pretrained_model(experts)
    compressor.compress_model(experts)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out)
    floats = {k: v for k, v in state.items() if not EXPERT.match(k)}
    save_file({**floats, **experts.state_dict()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(out)
    return out


def library_dequantized(path: Path, out: Path):
    """transformers' float model of ``path`` with the weights compressed-tensors' own decompressors
    give (saved as a float folder and loaded by ``from_pretrained``, which fuses the experts)."""
    from safetensors.torch import save_file

    from tests.hf_models import ct_decompressed_tensors, load_hf

    floats = ct_decompressed_tensors(path)
    out.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in floats.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return load_hf(out)


@pytest.fixture(scope="module")
def quantized_moe(hf_model_dir, tmp_path_factory):
    path = quantize_experts(hf_model_dir("qwen3_moe"), tmp_path_factory.mktemp("q") / "qwen3_moe-w4a16")
    return path, library_dequantized(path, tmp_path_factory.mktemp("q") / "dequantized")


def test_w4a16_expert_logits_equal_the_library_dequantization(quantized_moe):
    """The paged forward pass (the engine's jitted step) over three prompts prefilled together: every
    position's log-probabilities against transformers running the weights compressed-tensors
    decompresses; the experts are held packed (int4, a scale per group of 16 inputs)."""
    import jax
    import torch

    from paged_jax.models.loader import load_model
    from paged_jax.weights import ExpertStack, QuantizedLinear
    from tests.model_helpers import PagedRunner
    from tests.test_quantized import LOGPROB_TOL

    path, oracle = quantized_moe
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    config, params = load_model(path)
    moe = params["layers"][0]["moe"]
    for name in ("gate", "up", "down"):
        stack = moe[name]
        assert isinstance(stack, ExpertStack) and isinstance(stack.linear, QuantizedLinear), name
        assert stack.linear.bits == 4 and stack.linear.values.dtype == jax.numpy.uint8
        assert stack.linear.values.shape[0] == 8
        assert stack.linear.scale.shape[1] == (48 if name == "down" else 64) // GROUP
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (4, 9, 15)]
    got = PagedRunner(config, params).prefill_logits(prompts)
    for p, logits in zip(prompts, got):
        with torch.no_grad():
            want = torch.log_softmax(oracle(torch.tensor([p])).logits[0], -1).numpy()
        mine = jax.nn.log_softmax(logits.astype(np.float32), -1)
        np.testing.assert_allclose(mine, want, atol=LOGPROB_TOL, rtol=0)


@pytest.mark.slow  # about 20 s: an engine
def test_w4a16_experts_through_the_engine(quantized_moe):
    """Greedy decoding through the engine (decoding steps of one to three tokens take the few-token
    path): tokens and every position's top-5 logprobs against the library's dequantization."""
    from tests.test_quantized import LOGPROB_TOL, PROMPTS, _engine_logprobs, _logprob_errors

    path, oracle = quantized_moe
    llm, runs = _engine_logprobs(path, PROMPTS, block_size=4)
    errors = _logprob_errors(oracle, runs)
    assert errors.max() < LOGPROB_TOL, errors.max()


def test_experts_stored_in_two_formats_are_refused(quantized_moe, tmp_path):
    """One layer's experts must be stored alike (one stack): an expert left float beside quantized
    ones is refused by name."""
    from safetensors.torch import load_file, save_file

    from paged_jax import LLM
    from paged_jax.errors import ModelLoadError

    path, oracle = quantized_moe
    bad = tmp_path / "mixed"
    shutil.copytree(path, bad)
    state = load_file(str(bad / "model.safetensors"))
    p = "model.layers.0.mlp.experts.3.up_proj."
    for leaf in ("weight_packed", "weight_scale", "weight_shape"):
        del state[p + leaf]
    state[p + "weight"] = oracle.model.layers[0].mlp.experts.gate_up_proj[3, 48:].detach().clone()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.experts\.\*\.up_proj: the experts of one "
                                             r"layer must be stored alike .*'DenseLinear\(w\)', 'QuantizedLinear\(bits=4"):
        LLM(str(bad), max_model_len=64)


@pytest.mark.slow  # about 30 s: a process with 2 CPU devices
def test_w4a16_experts_split_over_two_devices(quantized_moe, tmp_path):
    """tp=2: each device holds 4 of the 8 packed experts; greedy tokens equal transformers' on the
    library's dequantization."""
    from tests.test_tensor_parallel import PROMPTS, run_worker, transformers_greedy

    path, oracle = quantized_moe
    (got,) = run_worker(tmp_path, [dict(model=str(path), tp=2, prompts=PROMPTS[:4], max_tokens=8)], devices=2)
    assert got["shards"]["experts.gate"] == [[4, 32, 48]] * 2  # [experts, 64 inputs packed two to a byte, 48]
    assert got["tokens"] == transformers_greedy(oracle, PROMPTS[:4], 8)
