"""Speculative decoding in the engine: the n-gram proposer's drafts verified in the ragged step give
the tokens of the engine without speculation (greedy token for token; seeded sampling too, since each
token is drawn with plain decoding's key), under stop strings, max_tokens, n > 1, logprobs, prefix
caching and preemption, with the KV cache's blocks all returned."""

from __future__ import annotations

import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.engine_args import EngineArgs

# Speculating at every batch size (the default turns it off for steps of 8 sequences or more).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None}
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main():\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n"]


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(num_kv_blocks=128, max_model_len=256)


def _requests(plain: LLM):
    """Prompts and params: greedy at two lengths, a stop string cut out of the plain output (so it
    ends mid-draft), seeded sampling with n = 2 and logprobs."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    text = plain.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    prompts = PROMPTS + PROMPTS[:2] + [PROMPTS[2], PROMPTS[3]]
    params = [greedy] * 4 + [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=33),
                             SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                             SamplingParams(temperature=0.8, top_p=0.95, n=2, seed=7, max_tokens=30, logprobs=2)]
    return prompts, params, stop


def _check_same(plain_outs, spec_outs):
    for a, b in zip(plain_outs, spec_outs):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids, a.prompt
            assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason, x.stop_reason)
            if x.logprobs is not None:
                assert [set(d) for d in y.logprobs] == [set(d) for d in x.logprobs]
                for dx, dy in zip(x.logprobs, y.logprobs):
                    for t in dx:
                        assert _lp(dx[t]) == _lp(dy[t]) or abs(_lp(dx[t]) - _lp(dy[t])) < 1e-4


def _lp(v):
    return getattr(v, "logprob", v)


@pytest.mark.slow
def test_outputs_equal_the_engine_without_speculation_under_preemption_and_prefix_caching(plain_llm):
    prompts, params, stop = _requests(plain_llm)
    expected = plain_llm.generate(prompts, params, use_tqdm=False)
    assert expected[6].outputs[0].finish_reason == "stop"  # the stop string is hit
    # A cache too small for every request at once: requests are preempted (recomputed) mid-decode.
    spec = LLM(num_kv_blocks=14, max_model_len=256, enable_prefix_caching=True, speculative_config=SPEC)
    got = spec.generate(prompts, params, use_tqdm=False)
    _check_same(expected, got)
    engine = spec.llm_engine
    stats = engine.get_stats()
    assert stats["num_preemptions"]["recompute"] > 0
    sd = stats["spec_decode"]
    assert sd["num_accepted_tokens"] > 0 and sd["num_draft_tokens"] > sd["num_accepted_tokens"]  # some rejected
    assert 0 < sd["acceptance_rate"] < 1 and sd["mean_acceptance_length"] > 1
    engine.block_manager.check_invariants()
    engine.block_manager.reset_prefix_cache()
    assert engine.block_manager.gpu_allocator.num_free_blocks == engine.block_manager.gpu_allocator.num_total_blocks
    assert all(len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(got, params))


def test_outputs_equal_the_same_engine_with_speculation_set_aside():
    """The default set's check: one engine (a cache small enough to preempt), a batch run without its
    SpecDecoder and then with it: greedy at two lengths, a stop string hit mid-output, seeded n = 2."""
    llm = LLM(num_kv_blocks=6, max_model_len=64, max_num_seqs=4, enable_prefix_caching=True,
              speculative_config=SPEC)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    decoder, engine.spec_decoder = engine.spec_decoder, None
    text = llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[12:15]
    params = [SamplingParams(temperature=0.8, top_p=0.95, n=2, seed=3, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=0, max_tokens=24, stop=[stop])]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert expected[2].outputs[0].finish_reason == "stop"
    engine.spec_decoder = decoder
    # Both ways the runner scores drafts: a query tile per row (native's) and a decode row per token.
    for as_rows in (False, True):
        engine.runner.drafts_as_rows = as_rows
        preemptions = sum(engine.get_stats()["num_preemptions"].values())
        accepted = engine.get_stats()["spec_decode"]["num_accepted_tokens"]
        got = llm.generate(prompts, params, use_tqdm=False)
        _check_same(expected, got)
        stats = engine.get_stats()
        assert sum(stats["num_preemptions"].values()) > preemptions
        assert stats["spec_decode"]["num_accepted_tokens"] > accepted
        assert stats["spec_decode"]["num_draft_tokens"] > stats["spec_decode"]["num_accepted_tokens"]
        engine.block_manager.check_invariants()
        engine.block_manager.reset_prefix_cache()
        assert engine.block_manager.gpu_allocator.num_free_blocks == engine.block_manager.gpu_allocator.num_total_blocks
    with pytest.raises(ValueError, match="beam search|use_beam_search"):
        engine.add_request("beam", PROMPTS[0], SamplingParams(use_beam_search=True, best_of=2, temperature=0))


@pytest.mark.slow  # 90 s (warm-up); test_draft_rows.py checks the verification step's shape in the default set
def test_a_verification_step_of_many_drafted_rows_is_one_forward_pass():
    """Seven rows drafting at once (k = 4, native's query tiles: 35 tokens, 7 tiles, more than a
    prefill step's tile capacity of 4 at that token bucket) verify in one forward pass, not two, with
    plain decoding's greedy tokens."""
    llm = LLM(num_kv_blocks=64, max_model_len=128, speculative_config=SPEC)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    assert not runner.drafts_as_rows
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = PROMPTS + [p + "    x = 1\n" for p in PROMPTS[:3]]
    decoder, engine.spec_decoder = engine.spec_decoder, None
    expected = llm.generate(prompts, params, use_tqdm=False)
    engine.spec_decoder = decoder
    passes, drafted = [], []  # per executed step: forward passes, rows with drafts
    execute, run_step = runner.execute, runner.run_step

    def counting_execute(out, sampling, *args):
        passes.append(0)
        drafted.append(sum(bool(s.num_speculative_tokens) for s in sampling))
        return execute(out, sampling, *args)

    def counting_run_step(*args, **kwargs):
        passes[-1] += 1
        return run_step(*args, **kwargs)

    runner.execute, runner.run_step = counting_execute, counting_run_step
    got = llm.generate(prompts, params, use_tqdm=False)
    _check_same(expected, got)
    assert max(drafted) >= 5, drafted
    assert [n for n, d in zip(passes, drafted) if d] == [1] * sum(map(bool, drafted)), list(zip(passes, drafted))


@pytest.mark.slow  # 6 s; test_gpu.py's speculative case runs the same tiles in interpret mode in CI's 3.12 stage
def test_pallas_scores_a_rows_drafts_as_one_query_tile():
    """The Pallas kernels (interpret mode on the CPU) score a row's pending token and its drafts as one
    query tile of the prefill kernel, causal within the tile: plain decoding's greedy tokens and their
    logprobs, from the same engine with its SpecDecoder set aside, with drafts both accepted and rejected."""
    llm = LLM(attention_backend="pallas-interpret", num_kv_blocks=8, max_model_len=64, speculative_config=SPEC)
    engine = llm.llm_engine
    assert not engine.runner.drafts_as_rows  # the backend declares verifies_in_tiles
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    decoder, engine.spec_decoder = engine.spec_decoder, None
    expected = llm.generate(PROMPTS[3], params, use_tqdm=False)
    engine.spec_decoder = decoder
    got = llm.generate(PROMPTS[3], params, use_tqdm=False)
    _check_same(expected, got)  # tokens, and their logprobs within 1e-4
    sd = engine.get_stats()["spec_decode"]
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"], sd
    # The drafted steps ran as query tiles (a shape with tiles, every token's logits), not decode rows.
    assert any(key[3] and all_logits for key, all_logits in engine.runner._compiled)
    engine.block_manager.check_invariants()
    assert engine.block_manager.gpu_allocator.num_free_blocks == engine.block_manager.gpu_allocator.num_total_blocks


@pytest.mark.parametrize("config,message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown keys"),
    ({"model": 3, "num_speculative_tokens": 2}, "draft_model"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_refused_with_its_name(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=config)


def test_config_defaults_follow_vllm():
    c = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4}).speculative_config
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)



def test_speculation_is_off_from_a_measured_batch_size_unless_asked_otherwise():
    from paged_jax.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert EngineArgs(speculative_config=spec).speculative_config.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert EngineArgs(speculative_config={**spec, "disable_by_batch_size": None}).speculative_config \
        .disable_by_batch_size is None
    assert EngineArgs(speculative_config={**spec, "disable_by_batch_size": 3}).speculative_config \
        .disable_by_batch_size == 3


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama_gqa", "opt_pre", "gpt2", "mistral_window", "gemma2", "qwen3_window"])
def test_greedy_equal_without_speculation_per_family(hf_model_dir, variant):
    """Tiny random models of several families (sliding windows freeing blocks, soft-capping), small
    blocks: greedy tokens with speculation equal those without."""
    path = str(hf_model_dir(variant))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 4, 3, 4, 3, 4, 3, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        llm = LLM(path, block_size=4, num_kv_blocks=64, max_model_len=128, speculative_config=spec)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                   use_tqdm=False)]
        if spec:
            stats = llm.llm_engine.get_stats()["spec_decode"]
            assert stats["num_drafts"] > 0
            llm.llm_engine.block_manager.check_invariants()
    assert outs["spec"] == outs["plain"]
