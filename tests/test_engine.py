"""The engine end to end against Hugging Face greedy generation (the oracle), float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_jax import LLM, SamplingParams
from tests.hf_models import load_hf
from tests.slow_cases import slow_unless

NUM_PROMPTS = 32
MAX_TOKENS = 24


def make_prompts(vocab, n=NUM_PROMPTS, seed=0, lo=1, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


_HF_CACHE = {}


def hf_greedy(path, prompts, max_tokens=MAX_TOKENS):
    key = (str(path), tuple(map(tuple, prompts)), max_tokens)
    if key not in _HF_CACHE:
        model = load_hf(path)
        outs = []
        for p in prompts:
            with torch.no_grad():
                o = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
            outs.append(o[0, len(p):].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


def run_engine(path, prompts, max_tokens=MAX_TOKENS, **kw):
    llm = LLM(model=str(path), **kw)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"], stats
    llm.llm_engine.block_manager.check_invariants()


# GPT-2 (18 s) in -m slow: its greedy tokens are also checked against transformers by test_models.py
@pytest.mark.parametrize("variant", ["llama_gqa", "opt_post", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_greedy_batch_matches_hf(hf_model_dir, variant):
    path = hf_model_dir(variant)
    prompts = make_prompts(512)
    llm, got = run_engine(path, prompts, num_kv_blocks=256)
    want = hf_greedy(path, prompts)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: {g} != {w}"
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_matches_hf(hf_model_dir, mode):
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512)
    # 24 blocks of 8 tokens cannot hold 32 sequences of up to 83 tokens: preemption must happen.
    llm, got = run_engine(path, prompts, num_kv_blocks=24, block_size=8, preemption_mode=mode)
    assert got == hf_greedy(path, prompts)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"][mode] > 0, stats
    assert_all_free(llm)


@pytest.mark.parametrize("block_size", slow_unless([1, 8, 16, 32], {1, 16}))  # 8 and 32: -m slow
def test_greedy_independent_of_block_size(hf_model_dir, block_size):
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512)
    llm, got = run_engine(path, prompts, block_size=block_size, num_kv_blocks=4096 // block_size + 1)
    assert got == hf_greedy(path, prompts)
    assert_all_free(llm)


def test_greedy_with_chunked_prefill(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512)
    llm, got = run_engine(path, prompts, num_kv_blocks=256, enable_chunked_prefill=True, max_num_batched_tokens=32)
    assert got == hf_greedy(path, prompts)
    assert_all_free(llm)


def test_greedy_with_prefix_caching(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 512, size=40).tolist()
    prompts = [shared + p for p in make_prompts(512, n=16, lo=1, hi=20)] + make_prompts(512, n=16)
    llm, got = run_engine(path, prompts, num_kv_blocks=256, enable_prefix_caching=True, block_size=8)
    assert got == hf_greedy(path, prompts)
    # Run the same prompts again: now the prompts' blocks are found in the cache, so their
    # first step runs fewer tokens than the prompt holds.
    runner = llm.llm_engine.runner
    first_rows = {}
    execute = runner.execute

    def recording(out, *a):
        for r in out.scheduled:
            first_rows.setdefault(r.seq.seq_id, (r.start_pos, r.num_tokens, r.seq.get_prompt_len()))
        return execute(out, *a)

    runner.execute = recording
    again = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                         use_tqdm=False)
    runner.execute = execute
    assert [o.outputs[0].token_ids for o in again] == got
    hits = [start for start, n, plen in first_rows.values() if start > 0]
    assert len(hits) >= 16 and all(start % 8 == 0 for start in hits)
    assert_all_free(llm)


def test_overlong_prompt_finishes_with_reason_others_complete(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=64)
    prompts = [[5, 6, 7], list(range(3, 103)), [8, 9]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=5),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 0, 5]
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "length"
    assert "max_model_len" in (outs[1].finish_message or "")
    assert_all_free(llm)


def test_prompt_that_never_fits_is_rejected(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=4, block_size=4)
    outs = llm.generate(prompt_token_ids=[list(range(3, 40)), [5, 6]],
                        sampling_params=SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [] and "never fit" in outs[0].finish_message
    assert len(outs[1].outputs[0].token_ids) == 3
    assert_all_free(llm)


def test_pallas_backend_through_engine_matches_hf(hf_model_dir):
    """Both Pallas kernels (in interpret mode, so it also runs on the CPU); tokens equal HF's."""
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=6, hi=30)
    llm, got = run_engine(path, prompts, max_tokens=8, num_kv_blocks=64, attention_backend="pallas-interpret")
    assert got == hf_greedy(path, prompts, max_tokens=8)
    assert_all_free(llm)


def test_shared_prefix_blocks_are_mapped_not_recomputed(hf_model_dir):
    """Paper Sec. 4.4: a prefix computed once; requests starting with it map its full blocks."""
    path = hf_model_dir("llama_gqa")
    rng = np.random.default_rng(9)
    prefix = rng.integers(3, 512, size=43).tolist()  # 5 full blocks of 8 and 3 tokens
    prompts = [prefix + p for p in make_prompts(512, n=8, lo=1, hi=15, seed=4)]
    llm = LLM(model=str(path), num_kv_blocks=128, block_size=8)  # automatic prefix caching off
    handle = llm.add_prefix(prompt_token_ids=prefix)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    pinned = bm.get_pinned_blocks(handle)
    assert len(pinned) == 5 and bm.get_usage().num_used_gpu_blocks == 5
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), prompt_token_ids=p)
    engine.step()
    for i in range(len(prompts)):
        seq = engine._groups[f"r{i}"].seqs[0]
        assert bm.get_block_table(seq)[:5] == pinned
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    assert [outs[f"r{i}"] for i in range(len(prompts))] == hf_greedy(path, prompts)
    assert bm.get_usage().num_used_gpu_blocks == 5
    llm.release_prefix(handle)
    assert_all_free(llm)
