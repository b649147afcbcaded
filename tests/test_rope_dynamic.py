"""Dynamic NTK RoPE against transformers: tiny models whose original context (max_position_embeddings,
64) the prompts and generations cross, through the whole engine (chunked prefill, batching,
recompute preemption)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_jax import LLM, SamplingParams
from tests.hf_models import load_hf

ORIGINAL = 64  # max_position_embeddings of the dynamic variants (tests/hf_models.py)


def prompts_of(vocab, lens, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lens]


def hf_greedy(hf, prompt, num_tokens):
    """transformers' greedy tokens for one request, on a fresh rotary state: its module keeps the
    longest frequencies it has computed (``max_seq_len_cached``) from one ``generate`` to the next."""
    rotary = hf.model.rotary_emb
    rotary.inv_freq = rotary.original_inv_freq.clone()
    rotary.max_seq_len_cached = rotary.original_max_seq_len
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def paged_greedy(path, prompts, num_tokens, **kw):
    llm = LLM(model=str(path), **kw)
    # ignore_eos: the run goes on where transformers' min_new_tokens forbids EOS; a token list equal to
    # transformers' then never holds EOS, so neither side's EOS rule decided a token.
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def test_frequencies_equal_transformers_for_each_rotation_length(hf_model_dir):
    """Per token: the original set up to the original context, transformers' recomputed one past it."""
    import jax.numpy as jnp
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from paged_jax.models.layers import apply_rope
    from paged_jax.models.loader import load_config

    path = hf_model_dir("llama_dynamic")
    rope = load_config(path).rope_frequencies()
    hf = load_hf(path)
    original = hf.model.rotary_emb.original_inv_freq.numpy()
    np.testing.assert_array_equal(rope.inv_freq, original)
    lengths = [1, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 100, 255]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((len(lengths), 1, 16)), jnp.float32)
    positions = jnp.asarray([L - 1 for L in lengths], jnp.int32)
    got = np.asarray(apply_rope(x, (positions, jnp.asarray(lengths, jnp.int32)), rope))
    for row, L in enumerate(lengths):
        # transformers recomputes (for a call's longest position + 1) only past the original context
        freqs = ROPE_INIT_FUNCTIONS["dynamic"](hf.config, None, seq_len=torch.tensor(L))[0].numpy() \
            if L > ORIGINAL else original
        emb = np.concatenate([(L - 1) * freqs] * 2)
        xr = np.asarray(x[row, 0])
        want = xr * np.cos(emb) + np.concatenate([-xr[8:], xr[:8]]) * np.sin(emb)
        np.testing.assert_allclose(got[row, 0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["llama_dynamic", "qwen2_dynamic"])
def test_greedy_past_the_original_context_equals_transformers(hf_model_dir, variant):
    """Prompts within the original context that generate past it, and a prompt longer than it, in one batch."""
    path = hf_model_dir(variant)
    hf = load_hf(path)
    prompts = prompts_of(hf.config.vocab_size, [20, 50, 90])
    want = [hf_greedy(hf, p, 40) for p in prompts]
    _, got = paged_greedy(path, prompts, 40, block_size=8)
    assert got == want


def test_greedy_with_chunked_prefill_and_recompute_preemption_equals_transformers(hf_model_dir):
    """Prompts in 16-token chunks (the longest in six), and too few blocks for every sequence:
    recomputed sequences rerun their generated tokens as prompt, and those keep the rotation of
    their own position (the original prompt length decides)."""
    path = hf_model_dir("llama_dynamic")
    hf = load_hf(path)
    prompts = prompts_of(hf.config.vocab_size, [30, 45, 58, 70, 90, 40], seed=5)
    want = [hf_greedy(hf, p, 40) for p in prompts]
    llm, got = paged_greedy(path, prompts, 40, block_size=8, num_kv_blocks=40, preemption_mode="recompute",
                            max_num_batched_tokens=16)
    assert llm.llm_engine.get_stats()["num_preemptions"]["recompute"] > 0
    assert got == want


def test_prefix_sharing_across_requests_is_refused(hf_model_dir):
    path = hf_model_dir("llama_dynamic")
    with pytest.raises(ValueError, match="enable_prefix_caching.*dynamic RoPE"):
        LLM(model=str(path), enable_prefix_caching=True)
    llm = LLM(model=str(path), block_size=8)
    with pytest.raises(ValueError, match="add_prefix.*dynamic RoPE"):
        llm.add_prefix(prompt_token_ids=list(range(3, 40)))


def test_batch_rotation_lengths():
    """L = max(original prompt length, position + 1): a prompt chunk gets its whole prompt's length, a
    decode and a recomputed generated token their own position's; without a prompt length the chunk
    ends the prompt."""
    from paged_jax.executor.batch import SeqChunk, prepare_batch

    chunks = [SeqChunk([1] * 4, 8, [1, 2, 3], prompt_len=20),  # the middle of a 20-token prompt
              SeqChunk([1], 30, [4, 5, 6, 7], prompt_len=20),  # a decode
              SeqChunk([1] * 6, 18, [8, 9, 10], prompt_len=20),  # recomputed: prompt end, then generated tokens
              SeqChunk([1] * 3, 0, [11])]  # a whole prompt
    b = prepare_batch(chunks, block_size=8)
    assert b.rope_lengths[:b.num_tokens].tolist() == [20] * 4 + [31] + [20, 20, 21, 22, 23, 24] + [3] * 3
