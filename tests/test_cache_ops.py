"""cache_ops against numpy on tiny caches: copies, swap out, swap in, bucketing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.memory import BlockManager, cache_ops
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 12, 4, 2, 3


def random_caches(rng: np.random.Generator, dtype=jnp.float32):
    """Device caches filled with random values, and numpy copies of them."""
    ref = [tuple(rng.standard_normal((BLOCKS, BS, HEADS, DIM)).astype(np.float32) for _ in range(2))
           for _ in range(LAYERS)]
    return [(jnp.asarray(k, dtype), jnp.asarray(v, dtype)) for k, v in ref], ref


def as_numpy(kv_caches):
    return [(np.asarray(k, np.float32), np.asarray(v, np.float32)) for k, v in kv_caches]


def test_allocate_shapes_and_dtypes():
    kv = cache_ops.allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, DIM, jnp.bfloat16)
    host = cache_ops.allocate_host_pool(LAYERS, 5, BS, HEADS, DIM, jnp.bfloat16)
    assert len(kv) == len(host) == LAYERS
    assert kv[0][0].shape == (BLOCKS, BS, HEADS, DIM) and kv[0][0].dtype == jnp.bfloat16
    assert host[1][1].shape == (5, BS, HEADS, DIM) and host[1][1].dtype == jnp.bfloat16
    assert isinstance(host[0][0], np.ndarray) and not host[0][0].any()


@pytest.mark.parametrize("pairs", [[(1, 2)], [(3, 4), (5, 6), (3, 7)], [(i, i + 6) for i in range(1, 6)]])
def test_copy_blocks_matches_numpy(pairs):
    kv, ref = random_caches(np.random.default_rng(0))
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    kv = cache_ops.copy_blocks(kv, src, dst)
    for layer in ref:
        for arr in layer:
            arr[dst] = arr[src]
    np.testing.assert_array_equal(np.concatenate([np.stack(x) for x in as_numpy(kv)]),
                                  np.concatenate([np.stack(x) for x in ref]))


def test_copy_blocks_without_pairs_is_a_no_op():
    kv, ref = random_caches(np.random.default_rng(1))
    assert cache_ops.copy_blocks(kv, [], []) is kv
    with pytest.raises(ValueError, match="1 source blocks for 0"):
        cache_ops.copy_blocks(kv, [1], [])


def test_swap_out_then_in_round_trips():
    kv, ref = random_caches(np.random.default_rng(2))
    host = cache_ops.allocate_host_pool(LAYERS, 6, BS, HEADS, DIM)
    out = {3: 5, 7: 0, 1: 2}
    cache_ops.swap_out(kv, host, out)
    for i in range(LAYERS):
        for j in range(2):
            np.testing.assert_array_equal(host[i][j][list(out.values())], ref[i][j][list(out)])
            assert not host[i][j][[1, 3, 4]].any()  # untouched host blocks
    back = {5: 9, 0: 10, 2: 11}
    kv = cache_ops.swap_in(kv, host, back)
    got = as_numpy(kv)
    for i in range(LAYERS):
        for j in range(2):
            np.testing.assert_array_equal(got[i][j][[9, 10, 11]], ref[i][j][[3, 7, 1]])
            np.testing.assert_array_equal(got[i][j][1:9], ref[i][j][1:9])  # only padding touches block 0


def test_block_manager_plans_move_the_right_contents():
    """A forked pair swapped out and in reads back its own K/V, shared block included."""
    bm = BlockManager(block_size=BS, num_gpu_blocks=BLOCKS, num_cpu_blocks=6, watermark=0.0)
    parent = Sequence(0, list(range(6)))
    group = SequenceGroup("r", [parent])
    bm.allocate(group)
    parent.status = SequenceStatus.RUNNING
    child = parent.fork(1)
    bm.fork(parent, child)
    group.add(child)
    kv, _ = random_caches(np.random.default_rng(3))
    child.append_token_id(9)
    src, dst = bm.append_slot(child)
    kv = cache_ops.copy_blocks(kv, [src], [dst])
    before = {s.seq_id: np.stack([np.stack(x) for x in as_numpy(kv)])[:, :, bm.get_block_table(s)] for s in group.seqs}
    host = cache_ops.allocate_host_pool(LAYERS, 6, BS, HEADS, DIM)
    cache_ops.swap_out(kv, host, bm.swap_out(group))
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    kv = cache_ops.swap_in(cache_ops.allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, DIM), host, bm.swap_in(group))
    for seq in group.seqs:
        after = np.stack([np.stack(x) for x in as_numpy(kv)])[:, :, bm.get_block_table(seq)]
        np.testing.assert_array_equal(after, before[seq.seq_id])
    bm.check_invariants()


def test_compiled_shapes_are_bucketed():
    kv, _ = random_caches(np.random.default_rng(4))
    host = cache_ops.allocate_host_pool(LAYERS, BLOCKS, BS, HEADS, DIM)
    start = cache_ops.num_compiled_shapes()
    for n in range(1, 11):  # buckets 8 and 16
        blocks = list(range(1, n + 1))
        kv = cache_ops.copy_blocks(kv, blocks, blocks)
        mapping = dict(zip(blocks, blocks))
        cache_ops.swap_out(kv, host, mapping)
        kv = cache_ops.swap_in(kv, host, mapping)
    grown = {k: v - start[k] for k, v in cache_ops.num_compiled_shapes().items()}
    assert all(v <= 2 for v in grown.values()), grown
    assert [cache_ops.bucket_size(n) for n in (0, 1, 8, 9, 17)] == [8, 8, 8, 16, 32]


def test_one_step_swaps_out_two_groups_sharing_blocks():
    """Two requests sharing cached prefix blocks, preempted by swap in the same step: the plan
    sends the shared device blocks to two host blocks, and each request's host table holds its K/V."""
    from paged_jax.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

    bm = BlockManager(block_size=BS, num_gpu_blocks=BLOCKS, num_cpu_blocks=BLOCKS, watermark=0.0,
                      enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, preemption_mode="swap"), bm)
    groups = []
    for i, prompt in enumerate([list(range(9)), list(range(9)) + [50]]):
        seq = Sequence(100 + i, prompt)
        group = SequenceGroup(f"g{i}", [seq])
        bm.allocate(group)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.get_len()
        bm.mark_blocks_computed(seq)
        groups.append(group)
    device_tables = [bm.get_block_table(g.seqs[0]) for g in groups]
    assert device_tables[0][:2] == device_tables[1][:2]  # shared prefix blocks
    out = SchedulerOutput()
    for g in groups:
        sched._preempt(g, out)
    kv, ref = random_caches(np.random.default_rng(5))
    host = cache_ops.allocate_host_pool(LAYERS, BLOCKS, BS, HEADS, DIM)
    cache_ops.swap_out(kv, host, out.blocks_to_swap_out)
    for g, dev in zip(groups, device_tables):
        host_table = bm.get_block_table(g.seqs[0])
        for i in range(LAYERS):
            for j in range(2):
                np.testing.assert_array_equal(host[i][j][host_table], ref[i][j][dev])
    bm.check_invariants()
