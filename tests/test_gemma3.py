"""Gemma 3 (text) against transformers: greedy tokens through the engine with prompts longer than the
window of its five windowed layers, and the RoPE of each layer kind as transformers computes it."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.hf_models import load_hf


@pytest.mark.slow  # about 12 s; the default set checks the logits past the make-tiny model's window (test_models.py)
def test_gemma3_greedy_equals_transformers_past_the_window(hf_model_dir):
    """Prompts of 5 to 33 tokens over a 6-token window (on layers 0-4; layer 5 sees everything), in one
    batch over 4-token blocks, 16 new tokens each: each equals transformers' ``generate`` alone."""
    from paged_jax import LLM, SamplingParams

    path = hf_model_dir("gemma3")
    hf = load_hf(path)
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and hf.config.sliding_window == 6
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (5, 20, 33)]
    llm = LLM(str(path), block_size=4, max_model_len=96)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == want[0, len(p):].tolist()


BASE = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=32, hidden_size=32,
            intermediate_size=64, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            sliding_window=8)


@pytest.mark.parametrize("rope", [
    # transformers 5's form: one entry per layer kind
    dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # the released checkpoints' form: the global base, the local base, scaling for the global layers
    dict(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    dict(rope_theta=5e5, rope_local_base_freq=2e4, sliding_window_pattern=3),
])
def test_each_layer_kind_rotates_as_transformers_does(rope):
    import transformers

    from paged_jax.models import LayerAttention, model_config_from_hf
    from paged_jax.models.gemma3 import rope_of

    cfg = dict(BASE, **rope)
    ours = model_config_from_hf(cfg)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Gemma3TextConfig(**cfg)).model
    assert [ours.attention_spec(i).sliding_window for i in range(7)] == [
        8 if kind == "sliding_attention" else None for kind in hf.config.layer_types]
    assert "full_attention" in hf.config.layer_types and "sliding_attention" in hf.config.layer_types
    for i, kind in enumerate(hf.config.layer_types):
        layer_attn = LayerAttention(ours.attention_spec(i), meta=None, backend=None)  # as models.forward makes it
        np.testing.assert_allclose(rope_of(ours, layer_attn).inv_freq,
                                   getattr(hf.rotary_emb, f"{kind}_inv_freq").numpy(), rtol=1e-6)


def test_gemma3_refuses_scaling_on_the_windowed_layers():
    from paged_jax.errors import ModelLoadError
    from paged_jax.models import model_config_from_hf

    with pytest.raises(ModelLoadError, match="sliding-window layers.*not supported"):
        model_config_from_hf(dict(BASE, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}))


@pytest.mark.slow  # about 20 s: transformers builds the 12B model's modules (on the meta device)
def test_the_gemma3_12b_setup_is_transformers_model():
    """experiments/hardware.py's Gemma 3 12B: its layer kinds are those transformers gives the same config,
    and the weights the cost model reads (attention, MLP, the tied embedding once) are that model's
    parameters less its norms (built on the meta device: no memory)."""
    import transformers

    from experiments.hardware import SETUPS, num_params

    setup = SETUPS["gemma3-12b"]
    m = setup.model
    cfg = transformers.Gemma3TextConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                        intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                                        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                        head_dim=m.head_dim, sliding_window=1024, sliding_window_pattern=6)
    assert [m.attention_spec(i).sliding_window is None for i in range(m.num_layers)] == [
        t == "full_attention" for t in cfg.layer_types]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    params = {id(p): p for p in hf.parameters()}.values()  # the tied embedding once
    weights = sum(p.numel() for p in params if p.dim() > 1)
    assert num_params(m) == weights
    assert 100_000 < setup.kv_slots < 130_000  # 0.9 x 80 GB less 23.5 GB of weights, at 384 KiB a token
