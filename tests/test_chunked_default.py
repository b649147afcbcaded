"""The default engine chunks long prompts beside running decodes (decode first), and
``enable_chunked_prefill=False`` keeps the paper's whole-prompt steps."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_args import MIN_CHUNKED_BUDGET, EngineArgs, default_chunked_budget

STREAMS, LONG = 3, 600


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from paged_jax.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-long"), family="llama", seed=0,
                               max_position_embeddings=1024))


def test_default_budget_rule():
    assert EngineArgs().enable_chunked_prefill is True
    assert default_chunked_budget(4) == MIN_CHUNKED_BUDGET == 256
    assert default_chunked_budget(256) == 256 and default_chunked_budget(1000) == 1000


def run_streams_and_long_prompt(engine):
    """Streams decode, then a long prompt arrives. Returns, for each step until the long prompt's
    first token: (the streams that got a token, the long prompt's tokens scheduled that step)."""
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    streams = [f"s{i}" for i in range(STREAMS)]
    for rid in streams:
        engine.add_request(rid, None, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                           rng.integers(3, vocab, size=8).tolist())
    for _ in range(3):
        engine.step()
    engine.add_request("long", None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       rng.integers(3, vocab, size=LONG).tolist())
    stream_seqs = {g.request_id: g.seqs[0] for g in engine.scheduler.running}
    assert sorted(stream_seqs) == streams
    steps = []
    long_seq = engine.scheduler.waiting[-1].seqs[0]
    while True:
        before = long_seq.num_computed_tokens
        lens = {rid: seq.get_output_len() for rid, seq in stream_seqs.items()}
        outs = {o.request_id: o for o in engine.step()}
        got = {rid for rid, seq in stream_seqs.items() if seq.get_output_len() > lens[rid]}
        steps.append((got, long_seq.num_computed_tokens - before))
        if "long" in outs and outs["long"].outputs[0].token_ids:
            break
    engine.abort_request(streams)
    return steps


def test_default_engine_chunks_a_long_prompt_and_serves_every_stream_each_step(long_model):
    engine = LLMEngine(EngineArgs(model=long_model, max_num_seqs=8, num_kv_blocks=128))
    budget = engine.scheduler_config.max_num_batched_tokens
    assert engine.scheduler_config.enable_chunked_prefill and budget == MIN_CHUNKED_BUDGET
    steps = run_streams_and_long_prompt(engine)
    assert len(steps) == -(-LONG // (budget - STREAMS))  # chunked: several steps, each full
    for got, chunk in steps:
        assert got == {f"s{i}" for i in range(STREAMS)}  # no stream waits a step for the prompt
        assert 0 < chunk <= budget - STREAMS
    assert sum(chunk for _, chunk in steps) == LONG


def test_chunked_prefill_off_runs_the_prompt_in_one_step(long_model):
    engine = LLMEngine(EngineArgs(model=long_model, max_num_seqs=8, num_kv_blocks=128, enable_chunked_prefill=False))
    assert not engine.scheduler_config.enable_chunked_prefill
    steps = run_streams_and_long_prompt(engine)
    assert [chunk for _, chunk in steps] == [LONG]
