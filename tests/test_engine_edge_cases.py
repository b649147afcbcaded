"""Regressions from review: swap plans with shared blocks, requests that can never run again."""

from __future__ import annotations

import pytest

from paged_jax import LLM, SamplingParams
from tests.test_engine import MAX_TOKENS, assert_all_free, hf_greedy, make_prompts


def test_groups_sharing_a_pinned_prefix_swap_out_together(hf_model_dir):
    """Requests sharing pinned prefix blocks, preempted by swap, still match HF greedy."""
    path = hf_model_dir("llama_gqa")
    prefix = make_prompts(512, n=1, lo=17, hi=18, seed=11)[0]  # 2 full blocks of 8
    prompts = [prefix + p for p in make_prompts(512, n=6, lo=3, hi=9, seed=12)]
    llm = LLM(model=str(path), num_kv_blocks=20, block_size=8, preemption_mode="swap")
    handle = llm.add_prefix(prompt_token_ids=prefix)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert llm.llm_engine.get_stats()["num_preemptions"]["swap"] > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts)
    llm.release_prefix(handle)
    assert_all_free(llm)


def test_group_that_outgrows_the_cache_ends_instead_of_hanging(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=6, block_size=4)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=None, ignore_eos=True))
    assert out[0].finished and "outgrew" in out[0].finish_message
    assert all(o.finish_reason == "length" for o in out[0].outputs)
    assert_all_free(llm)


def test_max_num_seqs_counts_every_sample(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_num_seqs=4)
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"r{i}", None, SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=4),
                           prompt_token_ids=[5, 6, 7])
    while engine.has_unfinished_requests():
        engine.step()
        assert sum(len(g.get_unfinished_seqs()) for g in engine.scheduler.running) <= 4
    big = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(n=5, temperature=1.0, max_tokens=2),
                       use_tqdm=False)[0]
    assert "max_num_seqs" in big.finish_message
    assert_all_free(llm)


def test_prompt_logprobs_complete_with_prefix_caching(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4, enable_prefix_caching=True)
    prompt = list(range(5, 19))
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)[0]
    second = llm.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)[0]
    assert len(second.prompt_logprobs) == len(prompt) == len(first.prompt_logprobs)
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a)
    assert_all_free(llm)


def test_add_prefix_that_cannot_run_raises(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_prefix(prompt_token_ids=list(range(3, 23)))
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_free(llm)


def test_failed_generate_leaves_no_request_behind(tiny_llama_dir):
    """A bad request in the middle of a batch raises, and the requests queued before it are
    dropped with their blocks: the next call runs on a clean engine."""
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64)
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9], [10, 10 ** 9]], sampling_params=good, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_free(llm)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=good, use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


def test_add_prefix_while_requests_run_loses_no_output(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    engine = llm.llm_engine
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       prompt_token_ids=[5, 6, 7])
    engine.step()
    handle = engine.add_prefix(prompt_token_ids=list(range(20, 41)))  # "a" finishes during these steps
    finals = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs), "one output per request and step"
        finals += [o for o in outs if o.finished]
    assert [o.request_id for o in finals] == ["a"] and len(finals[0].outputs[0].token_ids) == 2
    llm.release_prefix(handle)
    assert_all_free(llm)
