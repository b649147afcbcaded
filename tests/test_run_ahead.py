"""The next decode step dispatched before this one's tokens are read (``paged_jax.executor.run_ahead``):
the batch it runs is the one ``prepare_batch`` builds for the next step (the general path as the
oracle), it is taken only when the scheduler asks for exactly that step, and the engine's results
(tokens, logprobs, finish reasons, blocks) are bitwise those with it off, through stops, aborts and
preemption."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.executor.batch import SeqChunk, prepare_batch
from paged_jax.executor.run_ahead import AheadStep, next_decode_batch, same_step
from tests.test_engine import assert_all_free

BS = 4  # block size of the unit tests


def rows(chunks, max_tokens=None, outputs=0, seeds=(1,)):
    """Stand-ins for the scheduler's rows and the engine's RowSampling of decode ``chunks``."""
    out = SimpleNamespace(scheduled=[SimpleNamespace(start_pos=c.start_pos, seq=SimpleNamespace(
        get_output_len=lambda: outputs)) for c in chunks])
    sampling = [SimpleNamespace(seeds=seeds, params=SimpleNamespace(max_tokens=max_tokens)) for _ in chunks]
    return out, sampling


def fields(batch):
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def test_the_next_decode_batch_is_what_prepare_batch_builds_for_the_next_step():
    tables = [[3, 9, 4], [7, 2], [5]]
    starts = [9, 5, 1]  # none at a block's last slot; three rows: the batch has a padded fourth
    chunks = [SeqChunk([11 + s], p, t, prompt_len=[None, 12, None][s]) for s, (p, t) in enumerate(zip(starts, tables))]
    batch = prepare_batch(chunks, BS)
    ids = np.array([21, 22, 23, 0], np.int32)  # the step's argmax: the padded row's is 0
    nxt = next_decode_batch(batch, *rows(chunks), BS, ids)
    def next_step(tokens, tables=tables):
        return prepare_batch([SeqChunk([t], c.start_pos + 1, table, prompt_len=c.prompt_len)
                              for t, c, table in zip(tokens, chunks, tables)], BS, decode_path=False)  # the general path

    want = next_step([21, 22, 23])
    assert nxt.shape_key == want.shape_key
    for name, value in fields(want).items():
        assert np.array_equal(fields(nxt)[name], value), name
    # Taken only for exactly that step: its tokens the argmax read back, the same blocks, the same rows.
    ahead = AheadStep(nxt, ids, None)
    assert same_step(ahead, want)
    assert not same_step(ahead, next_step([21, 99, 23]))
    assert not same_step(ahead, next_step([21, 22, 23], [[3, 8, 4], [7, 2], [5]]))
    assert not same_step(ahead, prepare_batch(chunks[:2], BS))


def test_no_next_batch_at_a_block_boundary_at_the_last_token_or_with_several_samples():
    chunks = [SeqChunk([5], 6, [3, 9, 4]), SeqChunk([6], 1, [7])]
    batch = prepare_batch(chunks, BS)
    ids = np.zeros(2, np.int32)
    assert next_decode_batch(batch, *rows(chunks), BS, ids) is not None
    assert next_decode_batch(batch, *rows(chunks, max_tokens=5, outputs=3), BS, ids) is not None
    assert next_decode_batch(batch, *rows(chunks, max_tokens=5, outputs=4), BS, ids) is None  # its last token now
    assert next_decode_batch(batch, *rows(chunks, seeds=(1, 2)), BS, ids) is None
    at_boundary = [SeqChunk([5], 7, [3, 9, 4]), chunks[1]]  # position 8 would open the table's third block
    assert next_decode_batch(prepare_batch(at_boundary, BS), *rows(at_boundary), BS, ids) is None
    prefill = [SeqChunk([5, 6, 7], 0, [3])]
    assert next_decode_batch(prepare_batch(prefill, BS), *rows(prefill), BS, ids) is None


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # A small cache: four requests of the last test outgrow it (preemption).
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=12, block_size=16, max_num_seqs=4)


def generate(llm, prompts, params, ahead: bool):
    """Outputs with the runner's run-ahead on or off, and the steps taken from a step run ahead."""
    runner = llm.llm_engine.runner
    runner.run_ahead, before = ahead, runner.num_steps_run_ahead
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        runner.run_ahead = True
    assert_all_free(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.outputs[0].finish_reason,
             o.outputs[0].logprobs) for o in outs], runner.num_steps_run_ahead - before


def prompts_for(llm, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, llm.llm_engine.vocab_size, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def test_padded_rows_argmax_is_zero(llm):
    runner = llm.llm_engine.runner
    batch = prepare_batch([SeqChunk([5], 3, [1]), SeqChunk([6], 2, [2]), SeqChunk([7], 1, [3])], runner.block_size)
    ids = np.asarray(runner.run_step(batch).greedy_ids)
    assert ids.shape == (4,) and ids[3] == 0


def test_greedy_results_are_bitwise_those_without_it(llm):
    """Batch 1 and a batch whose requests end at different steps (max_tokens, a stop token met
    mid-way), logprobs asked by some: the same tokens, logprobs and finish reasons, most decode steps
    taken from a step run ahead. (tests/test_fused_greedy.py checks these tokens against transformers.)"""
    prompts = prompts_for(llm, 3)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    one, taken = generate(llm, prompts[:1], plain, ahead=True)
    assert one == generate(llm, prompts[:1], plain, ahead=False)[0]
    assert taken >= 20 - 1 - 2 - 2  # every decode step but the block boundaries' (at most 2) and the last
    stop = one[0][0][7]  # met by the first request at its eighth token
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True, logprobs=0 if i % 2 else None,
                             stop_token_ids=[stop] if i == 0 else []) for i in range(len(prompts))]
    got, taken = generate(llm, prompts, params, ahead=True)
    want, none = generate(llm, prompts, params, ahead=False)
    assert got == want and taken > 5 and none == 0
    assert got[0][2] == "stop" and len(got[0][0]) <= 8


def test_aborts_and_preemption_under_a_small_cache(llm):
    """Requests preempted (recomputed) for lack of blocks and one aborted between steps, run ahead or
    not: the same outputs, every block free at the end."""
    engine = llm.llm_engine
    prompts = prompts_for(llm, 4, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(ahead):
        engine.runner.run_ahead, before = ahead, engine.runner.num_steps_run_ahead
        preempted = sum(engine.scheduler.num_preemptions.values())
        for i, p in enumerate(prompts):
            engine.add_request(f"{ahead}{i}", None, params, prompt_token_ids=p)
        outs, steps = {}, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id[len(str(ahead)):]] = (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            steps += 1
            if steps == 20:
                engine.abort_request(f"{ahead}2")
        assert_all_free(llm)
        return outs, sum(engine.scheduler.num_preemptions.values()) - preempted, \
            engine.runner.num_steps_run_ahead - before

    got, preempted, taken = run(True)
    want, preempted_plain, _ = run(False)
    assert got == want and "2" not in got and len(got) == 3
    assert preempted == preempted_plain > 0 and taken > 0
    jax.block_until_ready(engine.runner.kv_caches)


def test_with_ngram_drafts_the_step_given_drafts_drops_the_one_run_ahead(tiny_llama_dir):
    """N-gram speculation keeps run-ahead on: a decode step with no drafts runs ahead; when the next
    step's rows get drafts (a verification), the step run ahead is dropped. Outputs equal those with it
    off, drafts are verified and accepted, every block is free at the end."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=16, max_num_seqs=4, speculative_config=spec)
    assert llm.llm_engine.runner.run_ahead
    prompts = [[5, 6, 7, 8] * 6, prompts_for(llm, 1, seed=2)[0]]  # a repetitive prompt finds drafts
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stats = llm.llm_engine.spec_decoder.stats
    got, taken = generate(llm, prompts, params, ahead=True)
    accepted = stats.num_accepted_tokens
    want, _ = generate(llm, prompts, params, ahead=False)
    assert got == want and taken > 0 and accepted > 0
    plain, _ = generate(LLM(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=16, max_num_seqs=4), prompts,
                        params, ahead=True)
    assert [g[0] for g in got] == [p[0] for p in plain]  # plain decoding's tokens (logprobs: a verification's rounding)
