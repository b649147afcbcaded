"""Model numerics against Hugging Face transformers (PyTorch, float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_jax.models import FAMILIES
from paged_jax.models.loader import load_model
from tests.hf_models import HF_VARIANTS, load_hf
from tests.model_helpers import PagedRunner
from tests.slow_cases import slow_unless

PROMPT_LENS = [1, 3, 5, 8, 13, 17, 24, 31]


# In the default suite: every attention kind (GQA, window, soft cap, qk-norm) and RoPE scaling
# (llama3, yarn, longrope; dynamic in tests/test_rope_dynamic.py) once; the other variants repeat a
# family's code with another config (tied or untied, pre or post norm) and run with -m slow. So do the
# long-prompt variants (opt_long, gpt2_long, llama_long_llama3: the code of opt_pre, gpt2 and
# llama_tied_scaled with room for 4,096 positions, which short prompts do not reach; their long prompts
# against transformers: tests/test_long_prompts.py).
LOGITS_VARIANTS = slow_unless(sorted(HF_VARIANTS), {"llama_gqa", "gemma2", "mistral_window", "qwen3_window", "phi3_longrope",
                                         "opt_pre", "llama_yarn", "llama_tied_scaled"})
# 32 greedy tokens: the decode steps over paged blocks, once per attention kind
GREEDY_VARIANTS = slow_unless(sorted(HF_VARIANTS), {"llama_gqa", "gemma2", "qwen3_window", "opt_pre"})
# The families of no variant above keep their tiny model's check against transformers in the default suite
TINY_FAMILIES = slow_unless(sorted(FAMILIES), {"gemma3", "gpt2", "gpt_oss", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe"})


def prompts_for(vocab, lens=PROMPT_LENS, seed=1):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, vocab, size=n)) for n in lens]


@pytest.mark.parametrize("variant", LOGITS_VARIANTS)
def test_prefill_logits_match_hf(hf_model_dir, variant):
    path = hf_model_dir(variant)
    config, params = load_model(path, dtype="float32")
    hf = load_hf(path)
    prompts = prompts_for(config.vocab_size)
    ours = PagedRunner(config, params, block_size=4).prefill_logits(prompts)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", GREEDY_VARIANTS)
def test_greedy_32_tokens_match_hf_generate(hf_model_dir, variant):
    path = hf_model_dir(variant)
    config, params = load_model(path, dtype="float32")
    hf = load_hf(path)
    prompts = prompts_for(config.vocab_size, seed=2)
    # The same block size and pool as test_prefill_logits_match_hf: its prompts' step shapes are
    # compiled once for both tests (the compiled steps on disk), and 32 decoding steps cross 8 blocks.
    ours = PagedRunner(config, params, block_size=4).greedy(prompts, 32, banned=config.eos_token_id)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0)
        assert got == out[0, len(p):].tolist()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_of_every_family_loads_in_hf_and_matches(family, tmp_path):
    """Each registered family's make-tiny defaults (its file's ``tiny_config``; the torch-free
    writer) give a folder transformers reads as the same model."""
    from paged_jax.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / family, family=family, seed=0)
    config, params = load_model(path)
    assert config.family == family
    hf = load_hf(path)
    prompt = prompts_for(config.vocab_size, lens=[11])[0]
    got = PagedRunner(config, params).prefill_logits([prompt])[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_unsupported_architecture_lists_the_supported_ones():
    from paged_jax.errors import ModelLoadError
    from paged_jax.models import model_config_from_hf

    with pytest.raises(ModelLoadError,
                       match="FalconForCausalLM.*supported: .*'MistralForCausalLM'.*'Qwen2ForCausalLM'"):
        model_config_from_hf({"architectures": ["FalconForCausalLM"]})
    with pytest.raises(ModelLoadError, match="model_type 'falcon'.*'GPT2LMHeadModel'"):
        model_config_from_hf({"model_type": "falcon"})


def test_qwen2_sliding_window_applies_to_the_layers_transformers_says():
    from paged_jax.errors import ModelLoadError
    from paged_jax.models import model_config_from_hf

    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    off = model_config_from_hf(dict(base, use_sliding_window=False, sliding_window=8))
    assert [off.attention_spec(i).sliding_window for i in range(4)] == [None] * 4
    on = model_config_from_hf(dict(base, use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert [on.attention_spec(i).sliding_window for i in range(4)] == [None, None, 8, 8]
    with pytest.raises(ModelLoadError, match="layer_types must list one of"):
        model_config_from_hf(dict(base, use_sliding_window=True, sliding_window=8, layer_types=["chunked"] * 4))


def test_mistral_window_is_on_every_layer_or_none():
    from paged_jax.errors import ModelLoadError
    from paged_jax.models import model_config_from_hf

    base = dict(architectures=["MistralForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    on = model_config_from_hf(dict(base, sliding_window=16))
    assert on.family == "mistral" and [on.attention_spec(i).sliding_window for i in range(3)] == [16] * 3
    off = model_config_from_hf(dict(base, sliding_window=None))
    assert [off.attention_spec(i).sliding_window for i in range(3)] == [None] * 3
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer or null, got 0"):
        model_config_from_hf(dict(base, sliding_window=0))
    with pytest.raises(ModelLoadError, match="layer_types"):
        model_config_from_hf(dict(base, sliding_window=16, layer_types=["full_attention"] * 3))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_float32(hf_model_dir, dtype):
    path = hf_model_dir("llama_gqa")
    c32, p32 = load_model(path, dtype="float32")
    c16, p16 = load_model(path, dtype=dtype)
    assert c16.dtype == dtype and str(p16["embed"].table.dtype) == dtype
    prompt = prompts_for(c32.vocab_size, lens=[9])
    a = PagedRunner(c32, p32).prefill_logits(prompt)[0]
    b = PagedRunner(c16, p16).prefill_logits(prompt)[0]
    assert np.max(np.abs(a - b)) < 0.1 * max(1.0, np.max(np.abs(a)))


@pytest.mark.parametrize("variant,block_size", [("gemma2", 8), ("gemma2", 16), ("mistral_window", 8),
                                                ("qwen3_window", 16), ("qwen2_tied_window", 8),
                                                ("phi3_longrope", 16)])
def test_newer_families_greedy_with_chunked_prefill_and_prefix_caching(hf_model_dir, variant, block_size):
    """Windows and soft-caps through the engine's other paths: prompts prefilled in 8-token chunks,
    the second prompt's shared prefix read from cached blocks; greedy tokens equal transformers'."""
    from paged_jax import LLM, SamplingParams

    path = hf_model_dir(variant)
    hf = load_hf(path)
    rng = np.random.default_rng(3)
    shared = list(rng.integers(3, hf.config.vocab_size, size=20))
    prompts = [shared + list(rng.integers(3, hf.config.vocab_size, size=n)) for n in (3, 9)]
    llm = LLM(str(path), block_size=block_size, max_model_len=128, enable_chunked_prefill=True,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        got = list(llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids)
        if i == 0:  # the first prompt's full blocks stay cached for the second
            assert llm.llm_engine.block_manager.get_usage().num_cached_gpu_blocks >= 1
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
        assert got == want[0, len(p):].tolist()


@pytest.mark.parametrize("block_size,num_tokens", [(8, 300), pytest.param(16, 1000, marks=pytest.mark.slow)])
def test_mistral_frees_the_blocks_its_window_has_passed(hf_model_dir, block_size, num_tokens):
    """Every layer attends through a 6-token window, so the block manager frees the blocks behind
    it: the sequence holds at most ceil(window / block_size) + 1 blocks at every decoding step, and its greedy
    tokens stay equal to transformers' over a generation many windows long."""
    from paged_jax import SamplingParams
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs

    path = hf_model_dir("mistral_window")
    hf = load_hf(path)
    window = hf.config.sliding_window
    prompt = prompts_for(hf.config.vocab_size, lens=[21], seed=4)[0]
    engine = LLMEngine(EngineArgs(model=str(path), block_size=block_size, max_model_len=num_tokens + 32))
    assert engine.block_manager.sliding_window == window
    engine.add_request("0", None, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True), prompt)
    most_blocks, got, steps = 0, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = list(out.outputs[0].token_ids)
        steps += 1
        if steps > 1 and engine.has_unfinished_requests():  # decoding (the prompt's step holds all its blocks)
            most_blocks = max(most_blocks, engine.block_manager.get_usage().num_used_gpu_blocks)
    assert most_blocks <= -(-window // block_size) + 1
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=0)
    assert got == want[0, len(prompt):].tolist()


def test_longrope_frequencies_and_their_switch_equal_transformers(hf_model_dir):
    """The short and long sets and the attention factor are transformers' own numbers; a token uses the
    long set from position original_max_position_embeddings on (its position alone decides)."""
    import jax.numpy as jnp
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from paged_jax.models.layers import apply_rope
    from paged_jax.models.loader import load_config

    path = hf_model_dir("phi3_longrope")
    hf_config = load_hf(path).config
    rope = load_config(path).rope_frequencies()
    inv, long_inv, switch, attention = rope.inv_freq, rope.long_inv_freq, rope.switch, rope.attention_factor
    short_hf, attention_hf = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=switch)
    long_hf, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=switch + 1)
    assert switch == 64 and attention == pytest.approx(attention_hf) and attention > 1
    np.testing.assert_allclose(inv, short_hf.numpy(), rtol=1e-6)
    np.testing.assert_allclose(long_inv, long_hf.numpy(), rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 16)), jnp.float32)
    got = np.asarray(apply_rope(x, jnp.asarray([switch - 1, switch]), rope))
    for row, (p, freqs) in enumerate([(switch - 1, inv), (switch, long_inv)]):
        emb = np.concatenate([p * freqs, p * freqs])
        cos, sin, rot = np.cos(emb) * attention, np.sin(emb) * attention, 2 * len(freqs)
        xr = np.asarray(x[row, 0, :rot])
        want = xr * cos + np.concatenate([-xr[rot // 2:], xr[:rot // 2]]) * sin
        np.testing.assert_allclose(got[row, 0, :rot], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[row, 0, rot:], np.asarray(x[row, 0, rot:]))  # not rotated
