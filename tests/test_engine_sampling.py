"""Sampling through the engine: seeds, n/best_of sharing, stops, logprobs, aborts, compilation count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_jax import LLM, SamplingParams
from paged_jax.sequence import SequenceStatus
from tests.hf_models import load_hf
from tests.test_engine import assert_all_free


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=16)


def gen(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_seeded_sampling_independent_of_batch(llm):
    prompt = [5, 17, 42, 99, 7]
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = gen(llm, [prompt], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=12, ignore_eos=True)]
    prompts = [[9, 8, 7], [3, 4, 5, 6, 7, 8, 9, 10] * 3, prompt, [11, 12]]
    crowd = gen(llm, prompts, [others[0], others[1], p, others[2]])
    assert crowd[2].outputs[0].token_ids == alone
    # A different seed gives a different draw (20 tokens from 512: equal only by a miracle).
    other_seed = gen(llm, [prompt], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_all_free(llm)


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    prompt = list(range(3, 23))  # 20 tokens: one full block and a partly filled one
    engine.add_request("n4", None, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
                       prompt_token_ids=prompt)
    engine.step()  # prefill: one copy of the prompt, then 4 samples forked from it
    group = engine._groups["n4"]
    assert len(group.seqs) == 4
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 2
    assert bm.get_usage().num_used_gpu_blocks == 2  # without sharing: 8
    engine.step()  # each sample writes its token into the shared partly filled block: copy-on-write
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert len({t[0] for t in tables}) == 1  # the full block is still shared by all four
    assert len({t[1] for t in tables}) == 4  # the last block diverged
    assert bm.get_usage().num_used_gpu_blocks == 5
    bm.check_invariants()
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs) == 4 and len({tuple(o.token_ids) for o in outs[0].outputs}) > 1
    assert_all_free(llm)


def test_best_of_returns_top_n_by_cumulative_logprob(llm):
    out = gen(llm, [[5, 6, 7]], SamplingParams(n=2, best_of=5, temperature=1.0, seed=0, max_tokens=5,
                                               ignore_eos=True))[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert_all_free(llm)


def test_stop_rules(llm):
    base = gen(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 30 and base.finish_reason == "length"
    # stop_token_ids: stops at the first occurrence, token kept in token_ids
    tok = base.token_ids[4]
    first = base.token_ids.index(tok)
    o = gen(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok], ignore_eos=True))
    o = o[0].outputs[0]
    assert o.token_ids == base.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == tok
    # min_tokens bans the stop token until reached
    o = gen(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok], min_tokens=first + 2,
                                             ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) >= first + 2 and tok not in o.token_ids[: first + 2]
    # stop string: trimmed from the text
    text = base.text
    stop = text[5:8]
    assert stop
    o = gen(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[: text.index(stop)]
    o = gen(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True,
                                             ignore_eos=True))[0].outputs[0]
    assert o.text == text[: text.index(stop) + len(stop)]
    assert_all_free(llm)


def test_logprobs_and_prompt_logprobs_match_hf(llm, tiny_llama_dir):
    prompt = [5, 17, 42, 99, 7, 250, 31]
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                                            ignore_eos=True))[0]
    comp = out.outputs[0]
    hf = load_hf(tiny_llama_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + comp.token_ids])).logits[0]
    ref = torch.log_softmax(logits, -1).numpy()
    # prompt logprobs: None for the first token, then the logprob of each next prompt token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        entry = out.prompt_logprobs[t]
        assert abs(entry[prompt[t]] - ref[t - 1, prompt[t]]) < 1e-4
        top2 = np.argsort(-ref[t - 1])[:2]
        assert set(top2) <= set(entry)
    # sample logprobs: the greedy token and the top 3
    assert len(comp.logprobs) == 4
    for k, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + k]
        assert tok == int(np.argmax(row))
        assert abs(entry[tok] - row[tok]) < 1e-4
        assert set(np.argsort(-row)[:3]) <= set(entry)
    assert abs(comp.cumulative_logprob - sum(e[t] for t, e in zip(comp.token_ids, comp.logprobs))) < 1e-4
    assert_all_free(llm)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=list(range(3, 40)))
    engine.add_request("b", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=[4, 5])
    engine.step()
    engine.step()
    engine.abort_request("a")
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request(["b", "unknown"])
    assert not engine.has_unfinished_requests()
    assert_all_free(llm)


def test_engine_rejects_bad_requests_and_keeps_running(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("x", None, SamplingParams(), prompt_token_ids=[1, 10**6])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("y", None, SamplingParams(), prompt_token_ids=[])
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("z", "hi", {"temperature": 0})
    out = gen(llm, [[5, 6]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) >= 1
    assert_all_free(llm)


def test_no_compilation_after_warmup(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(2, 40))).tolist() for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen(llm, prompts, params)
    before = llm.llm_engine.get_stats()["num_compilations"]
    gen(llm, prompts, params)
    assert llm.llm_engine.get_stats()["num_compilations"] == before
    assert_all_free(llm)


def test_text_prompts_and_detokenization(llm):
    tok = llm.get_tokenizer()
    out = llm.generate(["Hello, world!", "The capital of France is"], SamplingParams(temperature=0, max_tokens=10),
                       use_tqdm=False)
    for o in out:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_parallel_sampling_under_preemption_same_samples(llm, tiny_llama_dir, mode):
    """Seeded n / best_of samples are the same when a small cache forces whole groups to
    be swapped out or dropped and recomputed (each sample re-prefilled, common blocks shared)."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 500, size=k).tolist() for k in (5, 12, 20, 7, 30, 16)]
    params = [SamplingParams(n=n, best_of=b, temperature=0.8, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i, (n, b) in enumerate([(2, 2), (3, 4), (4, 4), (2, 3), (3, 3), (2, 2)])]
    roomy = gen(llm, prompts, params)
    small = LLM(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=8, preemption_mode=mode)
    scheduler = small.llm_engine.scheduler
    sizes = []
    original = scheduler._preempt
    scheduler._preempt = lambda g, o: (sizes.append(g.num_seqs(SequenceStatus.RUNNING)), original(g, o))
    tight = gen(small, prompts, params)
    assert small.llm_engine.get_stats()["num_preemptions"][mode] > 0 and max(sizes) > 1
    for a, b in zip(roomy, tight):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(c.finish_reason == "length" for c in b.outputs)
    assert_all_free(small)
