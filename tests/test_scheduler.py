"""Scheduler policy, without a model: a fake executor advances the sequences."""

from __future__ import annotations

import pytest

from paged_jax.memory.block_manager import BlockManager
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Scheduler, SchedulerConfig
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = iter(range(10**9))


def group(rid, prompt_len, max_tokens=8, arrival=0.0):
    seq = Sequence(next(_ids), list(range(3, 3 + prompt_len)))
    return SequenceGroup(rid, [seq], SamplingParams(max_tokens=max_tokens), arrival)


def make(num_blocks=64, block_size=4, cpu_blocks=64, **cfg):
    bm = BlockManager(block_size, num_blocks, cpu_blocks, watermark=0.0)
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("max_num_batched_tokens", 256)
    return Scheduler(SchedulerConfig(**cfg), bm)


def advance(sched, out):
    """What the engine does after a step: count computed tokens, append a token, finish at max_tokens."""
    for row in out.scheduled:
        row.seq.num_computed_tokens += row.num_tokens
    for row in out.scheduled:
        if row.seq.num_computed_tokens == row.seq.get_len():
            row.seq.append_token_id(1)
            if row.seq.get_output_len() >= row.group.sampling_params.max_tokens:
                row.seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                sched.free_seq(row.seq)
    sched.free_finished_seq_groups()
    sched.block_manager.check_invariants()


def run_to_end(sched, limit=1000):
    outs = []
    for _ in range(limit):
        if not sched.has_unfinished_seqs():
            return outs
        out = sched.schedule()
        outs.append(out)
        advance(sched, out)
    raise AssertionError("did not finish")


def test_fcfs_and_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add_seq_group(group(f"r{i}", 5))
    out = s.schedule()
    assert [r.group.request_id for r in out.scheduled] == ["r0", "r1"]
    assert all(r.num_tokens == 5 for r in out.scheduled)
    advance(s, out)
    assert [g.request_id for g in s.waiting] == ["r2", "r3"]
    run_to_end(s)
    assert s.block_manager.get_num_free_gpu_blocks() == s.block_manager.gpu_allocator.num_total_blocks


def test_chunked_prefill_keeps_decodes_running():
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=200)
    s.add_seq_group(group("short", 4, max_tokens=30))
    advance(s, s.schedule())
    s.add_seq_group(group("long", 100, max_tokens=2))
    steps_with_long_prefill = 0
    while s.has_unfinished_seqs():
        out = s.schedule()
        assert out.num_batched_tokens <= 16
        ids = [r.group.request_id for r in out.scheduled]
        long_rows = [r for r in out.scheduled if r.group.request_id == "long" and r.seq.get_output_len() == 0]
        if long_rows and not s.waiting:
            steps_with_long_prefill += 1
            if any(g.request_id == "short" for g in s.running) and not s.running[0].is_finished():
                assert "short" in ids  # the decode runs in the same iteration as the prefill chunk
        advance(s, out)
    assert steps_with_long_prefill >= 100 // 16


def test_chunked_prefill_serves_decodes_first_whatever_the_policy_order():
    """Decode first: even when the policy orders a long prompt ahead of the running streams
    (here newest first), the prompt's chunk only gets the budget the decodes leave, and every
    decoding stream gets its token in every step of the long prefill."""
    from paged_jax.policy import FCFS

    class NewestFirst(FCFS):
        def order_running(self, running):
            return list(reversed(running))

    s = make(max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=200, num_blocks=128,
             policy=NewestFirst())
    for i in range(6):
        s.add_seq_group(group(f"stream{i}", 2, max_tokens=60))
    advance(s, s.schedule())
    s.add_seq_group(group("long", 150, max_tokens=2))
    long_steps = 0
    while s.has_unfinished_seqs():
        out = s.schedule()
        assert out.num_batched_tokens <= 16
        rows = {r.group.request_id: r for r in out.scheduled}
        if "long" in rows and rows["long"].num_tokens > 1:
            long_steps += 1
            streams = [g.request_id for g in s.running if g.request_id != "long"]
            assert len(streams) == 6 and all(rows[rid].num_tokens == 1 for rid in streams), rows
            assert rows["long"].num_tokens == 16 - 6  # the chunk takes what the decodes leave
        advance(s, out)
    assert long_steps >= 150 // 10


def test_preempts_latest_arrival_first_and_swapped_return_before_new():
    # 10 usable blocks of 4 tokens; three requests grow until they do not fit.
    s = make(num_blocks=11, block_size=4, preemption_mode="swap")
    for i in range(3):
        s.add_seq_group(group(f"r{i}", 8, max_tokens=12, arrival=float(i)))
    advance(s, s.schedule())
    preempted = []
    while s.has_unfinished_seqs():
        if s.swapped:
            s.add_seq_group(group(f"late{len(preempted)}", 2, max_tokens=1, arrival=100.0))
        out = s.schedule()
        preempted += [g.request_id for g, mode in out.preempted]
        admitted_new = any(r.group.request_id.startswith("late") and r.seq.get_output_len() == 0
                           for r in out.scheduled)
        if admitted_new:
            assert not s.swapped  # a new prompt only once every swapped request is back
        advance(s, out)
    assert preempted and preempted[0] == "r2"
    assert s.num_preemptions["swap"] >= 1
    assert s.block_manager.get_num_free_gpu_blocks() == s.block_manager.gpu_allocator.num_total_blocks
    assert s.block_manager.get_num_free_cpu_blocks() == s.block_manager.cpu_allocator.num_total_blocks


def test_recompute_resets_and_requeues_at_front():
    s = make(num_blocks=7, block_size=4, preemption_mode="recompute")
    for i in range(2):
        s.add_seq_group(group(f"r{i}", 8, max_tokens=10, arrival=float(i)))
    s.add_seq_group(group("r2", 2, max_tokens=1, arrival=2.0))
    seen = []
    while s.has_unfinished_seqs():
        out = s.schedule()
        for g, mode in out.preempted:
            seen.append(g.request_id)
            assert g.seqs[0].num_computed_tokens == 0 and s.waiting[0] is g
        advance(s, out)
    assert seen and s.num_preemptions["recompute"] == len(seen)


def test_rejects_overlong_and_never_fitting_prompts():
    s = make(num_blocks=5, block_size=4, max_model_len=64)
    s.add_seq_group(group("long", 65))
    s.add_seq_group(group("huge", 40))  # 10 blocks > 4 usable
    s.add_seq_group(group("ok", 3))
    out = s.schedule()
    assert {g.request_id for g in out.ignored} == {"long", "huge"}
    assert "max_model_len" in out.ignored[0].finish_message
    assert [r.group.request_id for r in out.scheduled] == ["ok"]


def test_config_validation():
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=200)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_a_request_skipping_the_prefix_cache_waits_until_all_its_blocks_fit():
    """prompt_logprobs needs every prompt token computed, so admission must count every
    block, not the prefix-cache hits allocation will not use (else allocate raises)."""
    bm = BlockManager(4, 8, 0, watermark=0.0, enable_prefix_caching=True)  # 7 blocks of 4 tokens
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), bm)
    prompt = list(range(3, 19))  # 16 tokens: 4 blocks
    first = SequenceGroup("first", [Sequence(next(_ids), prompt)], SamplingParams(max_tokens=3))
    s.add_seq_group(first)
    advance(s, s.schedule())
    bm.mark_blocks_computed(first.seqs[0])
    logprobs = SamplingParams(max_tokens=1, prompt_logprobs=0)
    second = SequenceGroup("second", [Sequence(next(_ids), prompt + [99])], logprobs)  # 5 blocks, 4 cached
    s.add_seq_group(second)
    out = s.schedule()  # first grows to a 5th block: 2 free, fewer than the 5 the second takes
    assert [r.group.request_id for r in out.scheduled] == ["first"] and list(s.waiting) == [second]
    advance(s, out)
    rows = [r for out in run_to_end(s) for r in out.scheduled if r.group is second]
    assert rows[0].num_tokens == 17  # every prompt token computed (a cache hit would leave 1)


def test_a_request_carries_real_sampling_params():
    seq = Sequence(next(_ids), [1, 2, 3])
    assert SequenceGroup("default", [seq]).sampling_params == SamplingParams()
    with pytest.raises(TypeError, match="request 'bad': sampling_params must be a SamplingParams, got dict"):
        SequenceGroup("bad", [seq], {"max_tokens": 3})
