"""Beam search through the engine against Hugging Face ``generate(num_beams=k)``: the same
beams, in the same order, for LLaMA, OPT and Mistral (a 6-token window: blocks behind it freed), widths 2 and 4, each early_stopping setting,
with and without preemption; beams share their common history's blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_jax import LLM, SamplingParams
from paged_jax.sequence import SequenceStatus
from tests.hf_models import load_hf
from tests.test_engine import assert_all_free
from tests.slow_cases import slow_unless

MAX_NEW = 10
SETTINGS = [(2, False, 1.0), (2, True, 0.5), (4, "never", 1.5), (4, False, -0.5), (4, True, 1.0), (2, "never", 1.0)]


def _prompts(vocab_size, eos):
    rng = np.random.default_rng(5)
    out = []
    for n in (3, 9, 17):
        p = rng.integers(3, vocab_size, size=n).tolist()
        out.append([t for t in p if t != eos] or [3])
    return out


def _hf_beams(model, prompt, width, early_stopping, length_penalty, eos_ids):
    with torch.no_grad():
        seqs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, num_beams=width, num_return_sequences=width,
                              early_stopping=early_stopping, length_penalty=length_penalty,
                              max_new_tokens=MAX_NEW, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    beams = []
    for row in seqs[:, len(prompt):].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        beams.append(row[:cut])
    return beams


# opt_pre (learned positions, another family) runs with -m slow; mistral_window frees blocks
@pytest.fixture(scope="module", params=slow_unless(["llama_gqa", "opt_pre", "mistral_window"], {"llama_gqa", "mistral_window"}))
def case(request, hf_model_dir):
    path = hf_model_dir(request.param)
    hf = load_hf(path)
    eos = hf.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    prompts = _prompts(hf.config.vocab_size, eos)
    # A second stop token that the beams actually produce, so hypotheses end at different lengths:
    # the third token of the first prompt's best beam without it.
    stop = _hf_beams(hf, prompts[0], 2, False, 1.0, [eos])[0][2]
    return path, hf, prompts, [eos, stop]


# One pool size for the runs that need no memory pressure: a step shape compiled for one of them is
# loaded from disk by the others (the compiled steps' key holds the pool size).
AMPLE_BLOCKS = 1024


def _params(width, early_stopping, length_penalty, eos_ids):
    return SamplingParams(n=width, best_of=width, use_beam_search=True, temperature=0,
                          early_stopping=early_stopping, length_penalty=length_penalty,
                          max_tokens=MAX_NEW, stop_token_ids=[eos_ids[1]])


def _expected(hf, prompts, eos_ids):
    return {(i, s): _hf_beams(hf, p, *s, eos_ids) for i, p in enumerate(prompts) for s in SETTINGS}


def _run(llm, prompts, eos_ids):
    keys = [(i, s) for i, _ in enumerate(prompts) for s in SETTINGS]
    outs = llm.generate(prompt_token_ids=[prompts[i] for i, _ in keys],
                        sampling_params=[_params(*s, eos_ids) for _, s in keys], use_tqdm=False)
    return {k: [c.token_ids for c in o.outputs] for k, o in zip(keys, outs)}


def test_beam_search_matches_hf(case):
    path, hf, prompts, eos_ids = case
    want = _expected(hf, prompts, eos_ids)
    assert any(len(b) < MAX_NEW for beams in want.values() for b in beams), "no hypothesis ended early"
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=AMPLE_BLOCKS)
    got = _run(llm, prompts, eos_ids)
    for k in want:
        assert got[k] == want[k], f"prompt {k[0]}, (width, early_stopping, length_penalty)={k[1]}"
    assert_all_free(llm)


# swap: 14 s a family on 2 cores, in -m slow (recompute, and swap of parallel samples, stay in the default run)
@pytest.mark.parametrize("mode", [pytest.param("swap", marks=pytest.mark.slow), "recompute"])
def test_beam_search_under_preemption_matches_hf(case, mode):
    path, hf, prompts, eos_ids = case
    want = _expected(hf, prompts, eos_ids)
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=40, preemption_mode=mode)
    scheduler = llm.llm_engine.scheduler
    preempted_sizes = []
    original = scheduler._preempt

    def spy(group, out):
        preempted_sizes.append(group.num_seqs(SequenceStatus.RUNNING))
        original(group, out)
        assert not group.is_finished(), "a preempted beam search was aborted"

    scheduler._preempt = spy
    got = _run(llm, prompts, eos_ids)
    assert llm.llm_engine.get_stats()["num_preemptions"][mode] > 0
    assert max(preempted_sizes) > 1  # whole beam groups moved, not only single prompts
    for k in want:
        assert got[k] == want[k], f"prompt {k[0]}, (width, early_stopping, length_penalty)={k[1]}"
    assert_all_free(llm)


def test_beams_share_blocks(case):
    """Mid-search, the beams' tables hold fewer distinct blocks than their lengths need:
    the prompt and the common history are shared, diverged tails are owned."""
    path, _, prompts, eos_ids = case
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=AMPLE_BLOCKS)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    p = SamplingParams(n=4, best_of=4, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("b", None, p, prompt_token_ids=prompts[2])
    for _ in range(4):
        engine.step()
        group = engine._groups["b"]
        beams = group.get_seqs(SequenceStatus.RUNNING)
        assert len(beams) == 4
        tables = [bm.get_block_table(s) for s in beams]
        assert len({b for t in tables for b in t}) < sum(len(t) for t in tables)
        assert len({t[0] for t in tables}) == 1  # the prompt's first block
        bm.check_invariants()
    while engine.has_unfinished_requests():
        out = engine.step()
    assert len(out[0].outputs) == 4 and out[0].finished
    assert_all_free(llm)


def test_without_block_sharing_same_beams_more_blocks(case):
    """The copy-instead-of-share baseline (for measuring what sharing saves) finds the same
    beams, and holds more blocks at its peak."""
    path, hf, prompts, eos_ids = case
    want = _expected(hf, prompts[:2], eos_ids)
    peaks = {}
    for sharing in (True, False):
        llm = LLM(model=str(path), block_size=4, num_kv_blocks=AMPLE_BLOCKS, enable_block_sharing=sharing)
        engine = llm.llm_engine
        keys = [(i, s) for i in range(2) for s in SETTINGS]
        for j, (i, s) in enumerate(keys):
            engine.add_request(str(j), None, _params(*s, eos_ids), prompt_token_ids=prompts[i])
        got, peak = {}, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    got[keys[int(o.request_id)]] = [c.token_ids for c in o.outputs]
            peak = max(peak, engine.block_manager.get_usage().num_used_gpu_blocks)
            engine.block_manager.check_invariants()
        assert got == want
        assert_all_free(llm)
        peaks[sharing] = peak
    assert peaks[True] < peaks[False]


def test_beam_requests_ended_early_give_outputs_and_engine_runs_on(tiny_llama_dir):
    """Rejected or aborted beam searches end with a message; the step does not fail."""
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=12, max_model_len=32, max_num_seqs=4,
              swap_space=0, enable_chunked_prefill=True, max_num_batched_tokens=16)
    beam = lambda w: SamplingParams(n=w, best_of=w, use_beam_search=True, temperature=0, max_tokens=24,
                                    ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[list(range(3, 43)), [5, 6, 7], list(range(3, 20)), [8, 9]],
                        sampling_params=[beam(2), beam(8), beam(4), SamplingParams(temperature=0, max_tokens=4)],
                        use_tqdm=False)
    assert "max_model_len" in outs[0].finish_message and outs[0].finished
    assert "max_num_seqs" in outs[1].finish_message
    assert outs[2].finished  # width 4 without swap space outgrows 11 blocks: aborted, or finishes
    assert len(outs[3].outputs[0].token_ids) == 4
    assert_all_free(llm)


def test_beam_logprobs_give_the_requested_width(case):
    path, _, prompts, _ = case
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=128)
    p = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=4, logprobs=6,
                       ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompts[1]], sampling_params=p, use_tqdm=False)[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and len(entry) >= 6
