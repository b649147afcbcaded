"""The paper's baselines as policies of the one scheduler and block manager: Orca's
reservations (max / pow2 / oracle, buddy rounding) and FasterTransformer's static batching."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.memory.block_manager import BlockManager
from paged_jax.policy import FasterTransformer, Orca
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Scheduler, SchedulerConfig
from paged_jax.utils import pow2_bucket
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.test_scheduler import advance
from tests.slow_cases import slow_unless

_ids = iter(range(10**9))
BS = 4


def group(rid, prompt_len, max_tokens):
    seq = Sequence(next(_ids), list(range(3, 3 + prompt_len)))
    return SequenceGroup(rid, [seq], SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def make(num_blocks=65, **cfg):
    bm = BlockManager(BS, num_blocks, 64, watermark=0.0)
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("max_num_batched_tokens", 256)
    return Scheduler(SchedulerConfig(**cfg), bm)


def step(sched):
    """Schedule, then do what the engine does (see tests/test_scheduler.py's ``advance``)."""
    out = sched.schedule()
    advance(sched, out)
    return out


def blocks_of(sched, g):
    return len(sched.block_manager.get_block_table(g.seqs[0]))


@pytest.mark.parametrize("mode,buddy,prompt,out,expect_tokens", [
    ("max", False, 5, 10, 64),
    ("oracle", False, 5, 10, 15),
    ("oracle", True, 5, 10, 16),
    ("pow2", False, 5, 10, 5 + 16),
    ("pow2", True, 5, 10, 32),
    ("oracle", False, 50, 30, 64),  # capped at max_model_len
])
def test_reservation_sizes_and_no_growth(mode, buddy, prompt, out, expect_tokens):
    s = make(policy=Orca(mode, buddy_allocator=buddy))
    g = group("a", prompt, out)
    s.add_seq_group(g)
    assert s.reservation(g)[1] == expect_tokens
    step(s)
    reserved = -(-expect_tokens // BS)
    assert blocks_of(s, g) == reserved  # everything reserved at admission
    assert s.block_manager.get_usage().num_reserved_blocks == reserved - -(-(prompt + 1) // BS)
    while s.has_unfinished_seqs():
        if g.seqs[0].get_len() <= expect_tokens and not g.is_finished():
            assert blocks_of(s, g) == max(reserved, -(-g.seqs[0].get_len() // BS))
        step(s)
    assert s.block_manager.get_num_free_gpu_blocks() == 64


def test_reservation_limits_the_batch_like_orca():
    # 64 free blocks of 4 = 256 slots; Orca(Max) reserves 64 tokens = 16 blocks: four requests fit.
    s = make(policy=Orca("max"))
    for i in range(6):
        s.add_seq_group(group(f"r{i}", 3, 5))
    out = step(s)
    assert [r.group.request_id for r in out.scheduled] == ["r0", "r1", "r2", "r3"]
    assert s.block_manager.get_num_free_gpu_blocks() == 0
    # Paged (no reservation): all six fit and only the tokens' blocks are used.
    p = make()
    for i in range(6):
        p.add_seq_group(group(f"r{i}", 3, 5))
    assert len(step(p).scheduled) == 6
    assert p.block_manager.get_usage().num_reserved_blocks == 0


def test_oracle_batches_more_than_pow2_than_max():
    counts = {}
    for mode in ("max", "pow2", "oracle"):
        s = make(policy=Orca(mode, buddy_allocator=True))
        for i in range(40):
            s.add_seq_group(group(f"r{i}", 3 + i % 5, 5 + 3 * (i % 4)))
        counts[mode] = len(step(s).scheduled)
    assert counts["max"] < counts["pow2"] < counts["oracle"]


def test_static_batching_admits_only_when_the_batch_is_done():
    s = make(policy=FasterTransformer("max"))
    lens = [2, 9, 4]
    for i, n in enumerate(lens):
        s.add_seq_group(group(f"r{i}", 3, n))
    for i in range(3, 6):
        s.add_seq_group(group(f"r{i}", 3, 2))
    first = step(s)
    assert {r.group.request_id for r in first.scheduled} == {"r0", "r1", "r2", "r3"}
    batch = {"r0", "r1", "r2", "r3"}
    while s.running:
        out = step(s)
        assert {r.group.request_id for r in out.scheduled} <= batch  # nobody joins a running batch
    out = step(s)
    assert {r.group.request_id for r in out.scheduled} == {"r4", "r5"}
    while s.has_unfinished_seqs():
        step(s)


def test_reservation_larger_than_the_pool_is_rejected():
    s = make(num_blocks=9, policy=Orca("max"))  # 8 blocks = 32 slots < 64 reserved
    g = group("big", 3, 5)
    s.add_seq_group(g)
    out = s.schedule()
    assert out.ignored == [g] and g.seqs[0].status is SequenceStatus.FINISHED_IGNORED


def test_reserved_sequences_do_not_fork():
    s = make(policy=Orca("oracle"))
    g = group("a", 3, 5)
    s.add_seq_group(g)
    step(s)
    child = g.seqs[0].fork(next(_ids))
    with pytest.raises(ValueError, match="reservation"):
        s.block_manager.fork(g.seqs[0], child)


@pytest.mark.parametrize("make_bad,match", [
    (lambda: Orca("huge"), r"reservation must be one of \('max', 'pow2', 'oracle'\), got 'huge'"),
    (lambda: FasterTransformer(None), "reservation must be one of"),
    (lambda: Orca("max", buddy_allocator="yes"), "buddy_allocator must be True or False, got 'yes'"),
    (lambda: SchedulerConfig(policy="orca"), "policy must be a paged_jax.policy.SchedulingPolicy.*got 'orca'"),
])
def test_bad_policy_config(make_bad, match):
    with pytest.raises(ValueError, match=match):
        make_bad()


def test_reservation_rounding_is_the_next_power_of_two():
    assert [pow2_bucket(n) for n in (1, 2, 3, 16, 17, 2048)] == [1, 2, 4, 16, 32, 2048]


@pytest.mark.parametrize("system", ["vllm", "orca-max", "orca-pow2", "orca-oracle", "ft"])
# swap for the baselines (which reserve and never preempt) repeats recompute's run: -m slow
@pytest.mark.parametrize("preemption_mode", slow_unless(["recompute", "swap"], {"recompute"}))
def test_every_policy_keeps_the_block_manager_sound_under_load(system, preemption_mode):
    """A loaded trace (preemptions for the paged policy) through the real engine: invariants after
    every iteration, reservations only for the baselines, every request served."""
    from experiments.hardware import SETUPS
    from experiments.simulate import run_trace
    from experiments.workloads import make_trace

    def check(engine):
        engine.block_manager.check_invariants()
        for g in engine.scheduler.running:
            asked, alloc = engine.scheduler.reservation(g)
            assert (asked == 0) == (system == "vllm") and alloc >= asked
        return None

    num = 100 if system == "vllm" else 40
    reqs = make_trace("sharegpt", 20.0, num, seed=5, n=2 if system == "vllm" else 1)
    res = run_trace(SETUPS["opt-13b"], system, reqs, sample_every=1, on_sample=check, block_size=16,
                    preemption_mode=preemption_mode)
    assert len(res.latencies) == num and res.num_ignored == 0 and np.all(res.latencies > 0)
    if system == "vllm":
        assert sum(res.num_preemptions.values()) > 0
