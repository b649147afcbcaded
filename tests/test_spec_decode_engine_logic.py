"""The engine's speculative decoding logic without JAX: a fake model whose next token is a function of
the tokens before it, read back from its own paged KV cache (every slot holds a digest of the tokens up
to it: a slot lost by a rollback, overwritten in a shared block or stale after a swap fails the step).
Random workloads (prompts, max_tokens, stop tokens, n, preemption by recompute or swap, prefix
caching, drafts of 1-5 tokens) give the same outputs with and without speculation, with the block
manager's invariants after every step and every block free at the end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.engine import LLMEngine
from paged_jax.executor.interface import Sample, StepResult, check_sampling
from paged_jax.memory.block_manager import BlockManager
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import SchedulerConfig

VOCAB = 16
BS = 4


def next_token(tokens: list[int]) -> int:
    """Mostly a cycle through 1..5 (so n-gram drafts are often right), every ninth position a jump
    that depends on the length (so some are rejected)."""
    if len(tokens) % 9 == 0:
        return (tokens[-1] * 3 + len(tokens)) % (VOCAB - 1) + 1
    if tokens[-1] <= 5 or len(tokens) == 1:
        return tokens[-1] % 5 + 1
    return (tokens[-1] + tokens[-2]) % 5 + 1


class CacheModel:
    """Implements Executor. Runs each row's tokens into its blocks, checks every position the row
    attends to holds its own tokens' digest, and samples the next token at each scored position."""

    def __init__(self):
        self.timings = {}
        self.gpu: dict[int, dict[int, tuple]] = {}
        self.cpu: dict[int, dict[int, tuple]] = {}

    @property
    def num_compilations(self) -> int:
        return 0

    def warm_up(self, *args, **kwargs) -> int:
        return 0

    def execute(self, out, sampling=(), eos_token_id=None) -> StepResult:
        check_sampling(out, sampling)
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = dict(self.gpu.get(g, {}))
        for c, g in out.blocks_to_swap_in:
            self.gpu[g] = dict(self.cpu.get(c, {}))
        for s, d in out.blocks_to_copy:
            self.gpu[d] = dict(self.gpu.get(s, {}))
        result = StepResult()
        for i, row in enumerate(out.scheduled):
            tokens, end = row.seq.get_token_ids(), row.start_pos + row.num_tokens
            for pos in range(row.start_pos, end):
                self.gpu.setdefault(row.block_table[pos // BS], {})[pos % BS] = tuple(tokens[:pos + 1])
            for pos in range(end):
                held = self.gpu.get(row.block_table[pos // BS], {}).get(pos % BS)
                assert held == tuple(tokens[:pos + 1]), f"sequence {row.seq.seq_id} position {pos} holds {held}"
            spec = sampling[i]
            k = spec.num_speculative_tokens
            if k:
                assert len(spec.seeds) == 1
                result.samples[i] = [Sample(next_token(tokens[:end - k + j]), 0.0, None) for j in range(k + 1)]
            elif spec.seeds:
                result.samples[i] = [Sample(next_token(tokens[:end]), 0.0, None) for _ in spec.seeds]
        return result


def run(requests, spec_config, num_blocks, mode, caching):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, preemption_mode=mode,
                             enable_chunked_prefill=True)
    bm = BlockManager(BS, num_blocks, 64, watermark=0.0, enable_prefix_caching=caching)
    engine = LLMEngine.from_components(config, bm, CacheModel(), VOCAB, eos_token_id=0,
                                       speculative_config=spec_config)
    for rid, (prompt, params) in enumerate(requests):
        engine.add_request(str(rid), None, params, prompt_token_ids=prompt)
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
        bm.check_invariants()
    bm.reset_prefix_cache()
    assert bm.gpu_allocator.num_free_blocks == bm.gpu_allocator.num_total_blocks
    assert bm.cpu_allocator.num_free_blocks == bm.cpu_allocator.num_total_blocks
    return outputs, engine


request_st = st.tuples(
    st.lists(st.integers(1, VOCAB - 1), min_size=3, max_size=14),
    # The fake model ignores temperature and seeds (n = 2 draws the same tokens twice: forks and sharing).
    st.builds(lambda max_tokens, stops, n: SamplingParams(temperature=0 if n == 1 else 1.0, seed=n,
                                                          max_tokens=max_tokens, stop_token_ids=stops, n=n),
              st.integers(4, 24), st.lists(st.integers(1, VOCAB - 1), max_size=2), st.sampled_from([1, 1, 2])))


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(request_st, min_size=2, max_size=6), k=st.integers(1, 5), lookup_min=st.integers(1, 2),
       extra=st.integers(0, 2), num_blocks=st.integers(11, 20), mode=st.sampled_from([None, "recompute", "swap"]),
       caching=st.booleans())
def test_speculative_outputs_equal_plain_outputs(requests, k, lookup_min, extra, num_blocks, mode, caching):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_min + extra}
    plain, _ = run(requests, None, num_blocks, mode, caching)
    got, engine = run(requests, spec, num_blocks, mode, caching)
    for rid, out in plain.items():
        if out.finish_message or got[rid].finish_message:  # ended early by memory: depends on the schedule
            continue
        assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in got[rid].outputs] == \
               [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs], rid
    stats = engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]


def test_drafts_are_accepted_and_rejected_and_stop_mid_draft():
    """A fixed workload where drafts are both accepted and rejected, and a stop token ends a
    request at an accepted draft (the tokens after it are not appended)."""
    prompt = [3, 4, 5, 3, 4, 5, 3]
    plain_tokens = run([(prompt, SamplingParams(temperature=0, max_tokens=30))], None, 40, None, False)[0]["0"]
    tokens = plain_tokens.outputs[0].token_ids
    stop = tokens[12]
    requests = [(prompt, SamplingParams(temperature=0, max_tokens=30)),
                (prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    got, engine = run(requests, spec, 40, None, False)
    assert got["0"].outputs[0].token_ids == tokens
    assert got["1"].outputs[0].token_ids == tokens[:tokens.index(stop) + 1]
    assert got["1"].outputs[0].finish_reason == "stop"
    stats = engine.get_stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert engine.num_steps < len(tokens)  # several tokens a step


def test_disable_by_batch_size_turns_speculation_off_for_large_steps():
    prompt = [3, 4, 5, 3, 4, 5, 3]
    requests = [(prompt, SamplingParams(temperature=0, max_tokens=20))] * 3
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    plain, _ = run(requests, None, 40, None, False)
    for threshold, drafting in ((3, False), (4, True)):
        got, engine = run(requests, {**spec, "disable_by_batch_size": threshold}, 40, None, False)
        assert (engine.get_stats()["spec_decode"]["num_drafts"] > 0) is drafting
        assert [o.outputs[0].token_ids for o in got.values()] == [o.outputs[0].token_ids for o in plain.values()]
