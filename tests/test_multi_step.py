"""Multi-step decoding (num_scheduler_steps): greedy outputs equal transformers' and one-step decoding's,
seeded sampled ones one-step decoding's, under preemption, stops, prefix caching and mixed batches, and no
block is lost."""

from __future__ import annotations

import pytest

from paged_jax import LLM, EngineArgs, LLMEngine, SamplingParams
from tests.test_engine import MAX_TOKENS, assert_all_free, hf_greedy, make_prompts, run_engine


def multi_stats(llm):
    return llm.llm_engine.get_stats()["multi_step"]


def test_multi_step_greedy_matches_hf(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512)
    # 24 tokens: the first from the prompt's step, then 23 = 5 x 4 + 3 (the last loop keeps 3 of its 4 steps)
    llm, got = run_engine(path, prompts, num_kv_blocks=256, num_scheduler_steps=4)
    want = hf_greedy(path, prompts)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: {g} != {w}"
    stats = multi_stats(llm)
    assert stats["num_multi_steps"] >= 5 and stats["num_multi_step_tokens"] > 4 * stats["num_multi_steps"], stats
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_multi_step_under_preemption_matches_hf(hf_model_dir, mode):
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=12)
    # 12 sequences of up to 83 tokens in 24 blocks of 8: preempted while others decode several steps at a time
    llm, got = run_engine(path, prompts, num_kv_blocks=24, block_size=8, preemption_mode=mode, max_num_seqs=6,
                          num_scheduler_steps=8)
    assert got == hf_greedy(path, prompts)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"][mode] > 0, stats
    assert stats["multi_step"]["num_multi_steps"] > 0, stats
    assert_all_free(llm)


def test_stops_inside_a_loop_drop_the_tokens_after_them(hf_model_dir):
    """Stop ids, max_tokens and logprobs=0 as one-step decoding gives them: a stop in the middle of a loop's
    tokens ends the output there, and every block is freed."""
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=8)
    full = hf_greedy(path, prompts)
    # Each prompt stops at its own 7th-13th token (a token that does not occur before it in its output).
    params = []
    for i, out in enumerate(full):
        at = next(j for j in range(7 + i % 7, len(out)) if out[j] not in out[:j])
        params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS - i, stop_token_ids=[out[at]], logprobs=0))
    runs = {}
    for k in (1, 5):
        llm = LLM(model=str(path), num_kv_blocks=128, block_size=4, num_scheduler_steps=k)
        runs[k] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert_all_free(llm)
        if k > 1:
            assert multi_stats(llm)["num_multi_steps"] > 0
    for one, multi, out in zip(runs[1], runs[5], full):
        a, b = one.outputs[0], multi.outputs[0]
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "stop"
        assert b.token_ids == out[:len(b.token_ids)]
        assert [list(e) for e in b.logprobs] == [[t] for t in b.token_ids]
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, rel=1e-5, abs=1e-5)


def test_a_request_arriving_waits_one_engine_step(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    engine = LLMEngine(EngineArgs(model=str(path), num_kv_blocks=64, num_scheduler_steps=8))
    greedy = SamplingParams(temperature=0, max_tokens=40)
    engine.add_request("a", None, greedy, prompt_token_ids=[5, 6, 7, 8])
    engine.step()  # a's prompt
    out = engine.step()  # a decodes 8 tokens in one step
    assert len(out[0].outputs[0].token_ids) == 9
    engine.add_request("b", None, greedy, prompt_token_ids=[9, 10, 11])
    outs = {o.request_id: o for o in engine.step()}  # b's prompt runs at once, a's one token beside it
    assert len(outs["b"].outputs[0].token_ids) == 1 and len(outs["a"].outputs[0].token_ids) == 10
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def _tokens_and_logprobs(path, prompts, params, k, **kw):
    llm = LLM(model=str(path), num_kv_blocks=128, num_scheduler_steps=k, **kw)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert_all_free(llm)
    return llm, [[(c.token_ids, c.cumulative_logprob, c.finish_reason) for c in o.outputs] for o in outs]


def test_seeded_sampled_rows_in_a_loop_draw_one_step_decodings_tokens(hf_model_dir):
    """Seeded random rows (temperature, top-k, top-p, min-p; min_tokens banning EOS and a stop id; n = 2)
    decode in the loop, beside a greedy row, and draw the tokens and logprobs one-step decoding draws: the
    sampler's uniforms, processing and inverse CDF."""
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=5)
    eos = LLM(model=str(path), num_kv_blocks=16).llm_engine.eos_token_id
    params = [SamplingParams(temperature=0, max_tokens=20, logprobs=0),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3, max_tokens=20, logprobs=0),
              SamplingParams(temperature=1.2, min_p=0.05, seed=5, max_tokens=20, min_tokens=12, stop_token_ids=[7]),
              SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=20),
              SamplingParams(temperature=1.5, seed=13, max_tokens=20)]
    (_, one), (llm, multi) = (_tokens_and_logprobs(path, prompts, params, k) for k in (1, 4))
    stats = multi_stats(llm)
    assert stats["num_multi_steps"] >= 4 and stats["num_multi_step_tokens"] > 3 * stats["num_multi_steps"], stats
    for i, (a, b) in enumerate(zip(one, multi)):
        for (ta, la, fa), (tb, lb, fb) in zip(a, b):
            assert tb == ta and fb == fa, f"request {i}: {tb} != {ta}"
            assert lb == pytest.approx(la, rel=1e-4, abs=1e-4)
    # min_tokens held EOS and the stop id off for 12 tokens (the loop banned them as the sampler does)
    assert not {eos, 7} & set(multi[2][0][0][:12])
    assert len({tuple(c[0]) for c in multi[3]}) == 2  # n = 2: each sample its own seed


def test_unseeded_sampled_rows_draw_from_the_processed_distribution(hf_model_dir):
    """Unseeded random rows draw at the runner's own uniforms: top_k=1 leaves only the argmax
    (transformers' greedy tokens), and temperature 1 gives copies of one prompt different outputs."""
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=4)
    llm, outs = _tokens_and_logprobs(path, prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS), 4)
    assert [o[0][0] for o in outs] == hf_greedy(path, prompts)
    assert multi_stats(llm)["num_multi_steps"] > 0
    llm, outs = _tokens_and_logprobs(path, [prompts[0]] * 4, SamplingParams(temperature=1.0, max_tokens=16), 4)
    assert multi_stats(llm)["num_multi_steps"] > 0 and len({tuple(o[0][0]) for o in outs}) > 1


@pytest.mark.parametrize("penalised", [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
                                       SamplingParams(temperature=0.9, seed=5, max_tokens=12, presence_penalty=0.6,
                                                      frequency_penalty=0.4)], ids=["greedy", "sampled"])
def test_a_row_with_penalties_runs_the_step_one_token_at_a_time(hf_model_dir, penalised):
    """A row with penalties keeps its batch to one step at a time (the loop would compile again as its
    output grows), its tokens one-step decoding's."""
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=3)
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.8, seed=3, max_tokens=8),
              penalised]
    (_, one), (llm, multi) = (_tokens_and_logprobs(path, prompts, params, k) for k in (1, 4))
    assert multi == one and multi_stats(llm)["num_multi_steps"] == 0


def test_prefix_caching_with_multi_step(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    shared = list(range(3, 40))
    prompts = [shared + p for p in make_prompts(512, n=6, hi=20)]
    llm = LLM(model=str(path), num_kv_blocks=128, block_size=8, enable_prefix_caching=True, num_scheduler_steps=4)
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    first = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)]
    # Again: each prompt's full blocks come from the cache, so its first row starts past them
    runner, starts = llm.llm_engine.runner, {}
    execute = runner.execute

    def recording(out, *a):
        for r in out.scheduled:
            starts.setdefault(r.seq.seq_id, r.start_pos)
        return execute(out, *a)

    runner.execute = recording
    again = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)]
    assert first == again == hf_greedy(path, prompts)
    assert len(starts) == len(prompts) and all(s >= 32 for s in starts.values()), starts
    llm.llm_engine.block_manager.check_invariants()


def test_max_model_len_ends_a_sequence_inside_a_loop(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=4, lo=20, hi=30)
    outs = {}
    for k in (1, 8):
        llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=45, num_scheduler_steps=k)
        res = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=None),
                           use_tqdm=False)
        outs[k] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
        assert all(len(p) + len(t) == 45 and r == "length" for p, (t, r) in zip(prompts, outs[k]))
        assert_all_free(llm)
    assert outs[8] == outs[1]


def test_warm_up_compiles_the_decode_loops(hf_model_dir):
    path = hf_model_dir("llama_gqa")
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_seqs=4, max_model_len=64, num_scheduler_steps=4)
    engine = llm.llm_engine
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=20)
    engine.warm_up([SamplingParams(temperature=0), sampled], progress=False)
    compiled = engine.runner.num_compilations
    assert len(engine.runner.decode_loops.compiled) > 0
    outs = llm.generate(prompt_token_ids=make_prompts(512, n=4, hi=30),
                        sampling_params=[SamplingParams(temperature=0, max_tokens=20), sampled] * 2, use_tqdm=False)
    assert multi_stats(llm)["num_multi_steps"] > 0 and all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert engine.runner.num_compilations == compiled


@pytest.mark.parametrize("bad", [0, -2, 2.0, "4", True])
def test_bad_num_scheduler_steps(bad):
    with pytest.raises(ValueError, match=f"num_scheduler_steps must be an integer >= 1.*got {bad!r}"):
        EngineArgs(num_scheduler_steps=bad)


def test_num_scheduler_steps_refuses_speculation_and_a_latency_target():
    with pytest.raises(ValueError, match="num_scheduler_steps=4 is not supported with speculative decoding"):
        EngineArgs(num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_scheduler_steps=2 is not supported with a latency target"):
        EngineArgs(num_scheduler_steps=2, target_itl_ms=50.0)


def test_an_executor_without_decode_loops_is_refused():
    from paged_jax.memory.block_manager import BlockManager
    from paged_jax.scheduler import SchedulerConfig

    class Fake:
        timings, num_compilations = {}, 0

        def execute(self, out, sampling=(), eos_token_id=None):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="num_scheduler_steps > 1 needs the model on one device"):
        LLMEngine.from_components(SchedulerConfig(4, 64, 64), BlockManager(4, 16, 0), Fake(), 100,
                                  num_scheduler_steps=2)


def test_cli_passes_num_scheduler_steps():
    from paged_jax.cli import _llm, build_parser

    assert build_parser().parse_args(["generate"]).num_scheduler_steps == 1
    llm = _llm(build_parser().parse_args(["generate", "--num-scheduler-steps", "4", "--num-kv-blocks", "32"]))
    assert llm.llm_engine.multi_step.num_steps == 4
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 9 and multi_stats(llm)["num_multi_steps"] == 2


def test_multi_step_counters_in_metrics(hf_model_dir):
    from paged_jax.server.metrics import ServerMetrics

    path = hf_model_dir("llama_gqa")
    llm, got = run_engine(path, make_prompts(512, n=3), max_tokens=10, num_kv_blocks=64, num_scheduler_steps=4)
    # One prompt step, then 9 tokens a row: loops of 4, 4 and 1 (the last one token: a plain step)
    assert multi_stats(llm) == {"num_scheduler_steps": 4, "num_multi_steps": 2, "num_multi_step_tokens": 24}
    metrics = ServerMetrics()
    metrics.stats_source = llm.llm_engine.get_stats
    text = metrics.render()[0].decode()
    assert "paged_jax_multi_step_engine_steps_total 2.0" in text and "paged_jax_multi_step_tokens_total 24.0" in text
    plain, _ = run_engine(path, make_prompts(512, n=1), max_tokens=3, num_kv_blocks=64)
    metrics.stats_source = plain.llm_engine.get_stats
    assert "multi_step" not in metrics.render()[0].decode()


def test_a_prompt_continuing_a_stopped_output_reuses_its_blocks(hf_model_dir):
    """With prefix caching, the blocks a loop filled (before a stop inside it) stay in the cache: a later
    prompt that continues the output reuses them and still gets transformers' greedy tokens."""
    path = hf_model_dir("llama_gqa")
    prompt = make_prompts(512, n=1, lo=10, hi=11)[0]
    full = hf_greedy(path, [prompt])[0]
    stop = next(j for j in range(9, len(full)) if full[j] not in full[:j])  # the 10th+ token, mid-loop
    llm = LLM(model=str(path), num_kv_blocks=64, block_size=4, enable_prefix_caching=True, num_scheduler_steps=8)
    first = llm.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[full[stop]]))[0].outputs[0]
    assert first.token_ids == full[:stop + 1] and multi_stats(llm)["num_multi_steps"] > 0
    # The dropped tokens' K/V sit in the last blocks; the next prompt differs from them right after the stop.
    follow = prompt + full[:stop + 1] + [(full[stop + 1] + 1) % 509 + 3, 7, 11]
    runner, starts = llm.llm_engine.runner, []
    execute = runner.execute

    def recording(out, *a):
        starts.extend(r.start_pos for r in out.scheduled)
        return execute(out, *a)

    runner.execute = recording
    got = llm.generate(prompt_token_ids=[follow], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    assert starts[0] >= 4 * ((len(prompt) + stop) // 4), (starts[0], len(prompt) + stop)  # the cached blocks
    assert got == hf_greedy(path, [follow], max_tokens=12)[0]
    llm.llm_engine.block_manager.check_invariants()


def test_a_request_failing_inside_a_loop_ends_alone(hf_model_dir, monkeypatch):
    """Per-request fault isolation inside a loop: detokenizing one request's 3rd token of a loop raises;
    that request ends with "abort", the other keeps one-step decoding's tokens, no block is lost."""
    path = hf_model_dir("llama_gqa")
    prompts = make_prompts(512, n=2, lo=5, hi=9)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    failing = SamplingParams(temperature=0, max_tokens=20)
    llm, alone = run_engine(path, prompts, max_tokens=20, num_kv_blocks=64)
    llm = LLM(model=str(path), num_kv_blocks=64, block_size=4, num_scheduler_steps=4)
    engine = llm.llm_engine
    real, calls = engine._detokenize, {"n": 0}

    def detokenize(seq, params):
        if params is failing:
            calls["n"] += 1
            if calls["n"] == 7:  # the 3rd token of the second loop (the prompt's step gave the 1st)
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, params)

    monkeypatch.setattr(engine, "_detokenize", detokenize)
    out = llm.generate(prompt_token_ids=prompts, sampling_params=[greedy, failing], use_tqdm=False)
    assert out[1].outputs[0].finish_reason == "abort" and "injected" in out[1].finish_message
    assert out[1].outputs[0].token_ids == alone[1][:7]  # up to the token whose processing failed, none after it
    assert out[0].outputs[0].token_ids == alone[0] and multi_stats(llm)["num_multi_steps"] >= 4
    assert_all_free(llm)


def test_the_loops_draws_of_seeded_and_unseeded_rows():
    """multi_step_draws: an unseeded row draws at fresh uniforms of the runner's generator (each step and
    row its own), a seeded row at the sampler's key at its output's length (placeholders left out), a
    greedy row takes the argmax."""
    from types import SimpleNamespace

    import numpy as np

    from paged_jax.executor.decode_loop import multi_step_draws
    from paged_jax.executor.interface import RowSampling
    from paged_jax.sampling_tensors import SamplingTensors

    def row(outputs):  # a scheduled row whose sequence holds its outputs and 3 placeholders
        return SimpleNamespace(seq=SimpleNamespace(output_token_ids=outputs + [0, 0, 0], prompt_token_ids=[1, 2]))

    seeded, unseeded = SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.7)
    rows = [row([4, 5]), row([6]), row([7, 8, 9]), row([3])]
    sampling = [RowSampling(seeded, (1234,)), RowSampling(unseeded, (None,)), RowSampling(unseeded, (None,)),
                RowSampling(SamplingParams(temperature=0), (None,))]
    draws = multi_step_draws(rows, sampling, [4, 4, 4, 4], 4, 8, 64, None, np.random.default_rng(0))
    assert draws.keyed.tolist() == [True] + [False] * 7 and draws.sampled.tolist() == [True] * 3 + [False] * 5
    assert draws.history_len[:4].tolist() == [2, 1, 3, 0]
    one_step = SamplingTensors.from_params([(seeded, 1234, [1, 2], [4, 5])], 64)  # what the sampler would key
    assert (draws.tensors.key_data[0] == one_step.key_data[0]).all()
    assert draws.tensors.key_offset[0] == one_step.key_offset[0] == 2
    u = draws.uniforms[:, 1:3]
    assert ((u > 0) & (u < 1)).all() and len(np.unique(u)) == u.size  # fresh: per step and per row
    assert not draws.uniforms[:, 3:].any()
    assert multi_step_draws(rows[3:], sampling[3:], [4], 4, 8, 64, None, np.random.default_rng(0)) is None
