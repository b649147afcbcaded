"""One bad request never takes the engine down: validation closes the paths to an exception inside
``step()``, a request whose processing raises ends alone (finish reason "abort", blocks freed), and
``LLM.generate`` leaves nothing behind when it is interrupted."""

from __future__ import annotations

import pytest

from paged_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256)


def _assert_clean(engine) -> None:
    """No request left and every KV block free."""
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.block_manager.check_invariants()


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("ids", [[2 ** 31], [2 ** 63], [10 ** 6]])
def test_stop_token_ids_outside_the_vocabulary_are_refused(llm, ids):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=ids, min_tokens=1)
    with pytest.raises(ValueError, match=r"stop_token_ids hold ids outside the vocabulary \[0, \d+\)"):
        engine.add_request("bad-stop", "hi", params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi", "there"], params, use_tqdm=False)
    _assert_clean(engine)
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("length_penalty, early_stopping, max_tokens", [
    (2000.0, False, 8), (-2000.0, False, 8), (200.0, "never", 40), (1e300, True, 6)])
def test_beam_search_with_extreme_length_penalty_finishes(llm, length_penalty, early_stopping, max_tokens):
    params = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, length_penalty=length_penalty,
                            early_stopping=early_stopping, max_tokens=max_tokens)
    out = llm.generate(["The dragon", "Once"], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [2, 2]
    assert all(1 <= len(c.token_ids) <= max_tokens for o in out for c in o.outputs)
    _assert_clean(llm.llm_engine)


def test_one_failing_request_ends_alone(llm, monkeypatch):
    """Fault injection: detokenizing one request's tokens raises. That request ends with finish reason
    "abort" and a message naming the cause; the others finish as they would alone; no block is lost."""
    prompts = ["Story 0: the dragon", "Story 1: the dragon", "Story 2: the dragon"]
    sampled = SamplingParams(temperature=1.0, n=2, best_of=3, seed=7, max_tokens=8, ignore_eos=True)
    alone = [o.outputs for o in llm.generate(prompts, [GREEDY, sampled, GREEDY], use_tqdm=False)]
    engine = llm.llm_engine
    real = engine._detokenize
    calls = {"n": 0}

    def detokenize(seq, params):
        if params is sampled:
            calls["n"] += 1
            if calls["n"] == 5:  # a few tokens in, while all three run together
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, params)

    monkeypatch.setattr(engine, "_detokenize", detokenize)
    out = llm.generate(prompts, [GREEDY, sampled, GREEDY], use_tqdm=False)
    assert calls["n"] == 5
    failed = out[1]
    assert failed.finished and {c.finish_reason for c in failed.outputs} == {"abort"}
    assert "UnicodeDecodeError" in failed.finish_message and "injected" in failed.finish_message
    for i in (0, 2):
        assert [c.token_ids for c in out[i].outputs] == [c.token_ids for c in alone[i]]
        assert out[i].outputs[0].finish_reason == "length"
    _assert_clean(engine)


def test_failing_beam_bookkeeping_ends_that_request_alone(llm, monkeypatch):
    import paged_jax.engine_beams as engine_module  # the engine applies each beam step from here

    beam = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=8)
    want = llm.generate("Once", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    real = engine_module.beam_step
    calls = {"n": 0}

    def beam_step(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OverflowError("injected")
        return real(*args)

    monkeypatch.setattr(engine_module, "beam_step", beam_step)
    out = llm.generate(["The dragon", "Once"], [beam, GREEDY], use_tqdm=False)
    assert out[0].finished and "OverflowError: injected" in out[0].finish_message
    assert {c.finish_reason for c in out[0].outputs} == {"abort"}
    assert out[1].outputs[0].token_ids == want
    _assert_clean(llm.llm_engine)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_generate_leaves_no_request_and_no_block(llm, monkeypatch, exc):
    engine = llm.llm_engine
    real, steps = engine.step, {"n": 0}

    def step():
        steps["n"] += 1
        if steps["n"] == 3:
            raise exc("interrupted")
        return real()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(exc):
        llm.generate([f"prompt {i}" for i in range(4)], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    _assert_clean(engine)
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_request_that_can_never_fit_is_refused_up_front(tiny_llama_dir):
    """No silent truncation: prompt + max_tokens beyond the whole KV cache is a ValueError naming
    max_tokens and the most that fits; a request that fits exactly runs to max_tokens."""
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=6, block_size=4)  # 5 usable blocks: 20 tokens
    with pytest.raises(ValueError, match=r"max_tokens=18 can never fit in the KV cache.*at most 17"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=18), use_tqdm=False)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 17 and out.outputs[0].finish_reason == "length"
    _assert_clean(llm.llm_engine)
