"""Greedy sampling inside the model step: a batch asking nothing but argmax reads the step's own
tokens (no sampler call); any other batch takes the sampler. Same tokens either way, and the
transformers model's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax import LLM, SamplingParams
from paged_jax.executor import sampling as step_sampling
from paged_jax.sampling_tensors import SamplingTensors, argmax_only
from tests.test_engine import assert_all_free, hf_greedy

MAX_TOKENS = 10
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=16)


def prompts_for(llm, n, seed=0):
    rng = np.random.default_rng(seed)
    vocab = llm.llm_engine.vocab_size
    return [rng.integers(3, vocab, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def run(llm, prompts, params, force_sampler=False):
    """The outputs, and how many times the sampler was called (once per batch it draws for)."""
    sampler = llm.llm_engine.runner.sampler
    calls = []
    general = sampler._dispatch_sampler

    def counting(*args, **kw):
        calls.append(1)
        return general(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "_dispatch_sampler", counting)
        if force_sampler:  # the path before the step returned its argmax
            mp.setattr(step_sampling, "batch_is_argmax_only", lambda *a, **k: False)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert_all_free(llm)
    return outs, len(calls)


def test_greedy_batch_reads_the_steps_argmax(llm, tiny_llama_dir):
    """A greedy batch never calls the sampler, and gives transformers' tokens and the sampler's
    tokens and logprobs (``logprobs=0``: the token's own logprob entry, still argmax only)."""
    prompts = prompts_for(llm, 6)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0 if i % 2 else None)
              for i in range(len(prompts))]
    fused, calls = run(llm, prompts, params)
    assert calls == 0
    general, calls = run(llm, prompts, params, force_sampler=True)
    assert calls > 0
    assert [o.outputs[0].token_ids for o in fused] == hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    for f, g in zip(fused, general):
        f, g = f.outputs[0], g.outputs[0]
        assert f.token_ids == g.token_ids
        assert f.cumulative_logprob == pytest.approx(g.cumulative_logprob, abs=1e-5)
        assert f.cumulative_logprob < 0
        if g.logprobs is None:
            assert f.logprobs is None
        else:
            assert [list(e) for e in f.logprobs] == [list(e) for e in g.logprobs] == [[t] for t in f.token_ids]
            assert np.allclose([list(e.values()) for e in f.logprobs], [list(e.values()) for e in g.logprobs],
                               atol=1e-5)


def test_a_step_with_many_logits_rows_takes_the_sampler(tiny_llama_dir):
    """Past GREEDY_IN_STEP_MAX_LOGITS logits the step returns no greedy tokens: a greedy prompt whose
    prefill step has more rows draws its first token through the sampler, the rest from the step."""
    from paged_jax.executor.model_runner import GREEDY_IN_STEP_MAX_LOGITS

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=1024,
              max_num_batched_tokens=1024, enable_chunked_prefill=False)
    vocab = llm.llm_engine.vocab_size
    prompt = prompts_for(llm, 1, seed=2)[0] * 1000
    prompt = prompt[: GREEDY_IN_STEP_MAX_LOGITS // vocab + 1]  # one row more than the bound allows
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs, calls = run(llm, [prompt], params)
    assert calls == 1
    assert [outs[0].outputs[0].token_ids] == hf_greedy(tiny_llama_dir, [prompt], 6)


def test_past_the_bound_a_gpu_step_still_returns_its_argmax(tiny_llama_dir, monkeypatch):
    """The bound on the step's greedy tokens is the CPU's: where it does not apply (a GPU's backend,
    here the CPU taken off ``GREEDY_IN_STEP_BOUNDED_PLATFORMS``) a greedy prefill past it reads the
    step's own argmax (no sampler call) and gives transformers' tokens."""
    from paged_jax.executor import model_runner

    monkeypatch.setattr(model_runner, "GREEDY_IN_STEP_BOUNDED_PLATFORMS", ())
    monkeypatch.setenv("PAGED_JAX_NO_EXECUTABLE_CACHE", "1")  # compiled steps on disk have the CPU's bound
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=1024,
              max_num_batched_tokens=1024, enable_chunked_prefill=False)
    rows = model_runner.GREEDY_IN_STEP_MAX_LOGITS // llm.llm_engine.vocab_size + 1  # one row past the bound
    prompt = (prompts_for(llm, 1, seed=2)[0] * 1000)[:rows]
    outs, calls = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert calls == 0
    assert [outs[0].outputs[0].token_ids] == hf_greedy(tiny_llama_dir, [prompt], 6)


# Each asks for more than argmax: a draw, a penalty, banned EOS (min_tokens), top logprobs.
OTHERS = {"sampled": dict(temperature=0.8, seed=3), "penalty": dict(temperature=0, presence_penalty=1.5),
          "min_tokens": dict(temperature=0, min_tokens=4), "logprobs": dict(temperature=0, logprobs=2)}


@pytest.mark.parametrize("kind", list(OTHERS))
def test_batch_with_one_other_row_takes_the_sampler(llm, kind):
    """One row asking for more than argmax sends every batch it samples in to the sampler (with
    min_tokens only while EOS is banned); the greedy rows beside it keep their tokens."""
    prompts = prompts_for(llm, 4, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    other = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=kind != "min_tokens", **OTHERS[kind])
    alone, _ = run(llm, prompts[:3], greedy)
    other_alone, _ = run(llm, prompts[3:], other)
    mixed, calls = run(llm, prompts, [greedy] * 3 + [other])
    # Every batch the row samples in (one per token: the prompts prefill together), or the first 4.
    sampled_steps = 4 if kind == "min_tokens" else len(other_alone[0].outputs[0].token_ids)
    assert calls == sampled_steps
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[3].outputs[0].token_ids == other_alone[0].outputs[0].token_ids


_params = st.builds(
    dict,
    temperature=st.sampled_from([0.0, 0.0, 1e-6, 0.7]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.0, -0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.2]),
    min_tokens=st.sampled_from([0, 0, 3]),
    stop_token_ids=st.sampled_from([[], [], [7]]),
    ignore_eos=st.booleans(),
    logprobs=st.sampled_from([None, None, 0, 1, 5]),
    use_beam_search=st.sampled_from([False, False, False, True]),
)


@settings(max_examples=300, deadline=None)
@given(kw=_params, num_output=st.integers(0, 5), eos=st.sampled_from([None, EOS]), masked=st.booleans())
def test_argmax_only_is_the_samplers_bare_argmax(kw, num_output, eos, masked):
    """``argmax_only`` holds exactly when the sampler's arrays for that row ask for a bare argmax:
    all greedy, no penalty, no banned id, no grammar mask, no top-N."""
    if kw["use_beam_search"]:
        kw = dict(kw, best_of=2, temperature=0.0, min_tokens=0)
    try:
        p = SamplingParams(max_tokens=8, **kw)
    except ValueError:
        return  # a combination SamplingParams refuses
    if masked:
        p = dataclasses.replace(p)
        p.token_bitmask = np.full(1, -1, np.int32)
    t = SamplingTensors.from_params([(p, None if p.seed is None else 0, [5, 6], [9] * num_output)], 64,
                                    eos_token_id=eos)
    bare = (t.all_greedy and not t.do_penalties and t.banned_token_ids.shape[1] == 0
            and t.token_bitmask.shape[1] == 0 and t.num_top == 0)
    assert argmax_only(p, num_output, eos) == bare
