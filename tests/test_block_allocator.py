"""BlockAllocator: free list, reference counts, the null block, clear errors."""

from __future__ import annotations

import pytest

from paged_jax.memory import NULL_BLOCK, BlockAllocator, Device, DoubleFreeError, NoFreeBlocksError


def test_device_pool_never_hands_out_the_null_block():
    pool = BlockAllocator(Device.GPU, 4, reserve_null_block=True)
    assert pool.num_total_blocks == 3 and pool.num_free_blocks == 3
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [1, 2, 3] and NULL_BLOCK not in blocks
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_host_pool_uses_every_block():
    pool = BlockAllocator(Device.CPU, 3)
    assert pool.num_total_blocks == 3
    assert sorted(pool.allocate() for _ in range(3)) == [0, 1, 2]


def test_allocating_from_an_empty_pool_raises():
    pool = BlockAllocator(Device.GPU, 2, reserve_null_block=True)
    pool.allocate()
    with pytest.raises(NoFreeBlocksError, match="gpu pool has no free block"):
        pool.allocate()
    assert issubclass(NoFreeBlocksError, RuntimeError)


def test_double_free_raises_naming_block_and_pool():
    pool = BlockAllocator(Device.CPU, 2)
    block = pool.allocate()
    assert pool.decref(block) == 0
    pool.free(block)
    with pytest.raises(DoubleFreeError, match=f"block {block} of the cpu pool is already free"):
        pool.free(block)
    with pytest.raises(DoubleFreeError, match=f"block {block} of the cpu pool"):
        pool.decref(block)
    assert issubclass(DoubleFreeError, ValueError)
    pool.check_invariants()


def test_refcounts_and_parking():
    pool = BlockAllocator(Device.GPU, 3, reserve_null_block=True)
    block = pool.allocate()
    assert pool.incref(block) == 2 and pool.get_ref_count(block) == 2
    assert pool.decref(block) == 1 and pool.num_used_blocks == 1
    assert pool.decref(block) == 0
    # Parked: unreferenced, not free, not used: the owner keeps it as cache.
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 1 and pool.parked_blocks() == [block]
    with pytest.raises(DoubleFreeError):
        pool.decref(block)
    assert pool.incref(block) == 1 and pool.num_used_blocks == 1  # revived by a cache hit
    pool.decref(block)
    pool.free(block)
    assert pool.num_free_blocks == 2 and pool.parked_blocks() == []
    pool.check_invariants()


def test_invalid_operations():
    pool = BlockAllocator(Device.GPU, 3, reserve_null_block=True)
    with pytest.raises(ValueError, match="null block"):
        pool.free(NULL_BLOCK)
    with pytest.raises(ValueError, match="null block"):
        pool.incref(NULL_BLOCK)
    with pytest.raises(ValueError, match="out of range"):
        pool.get_ref_count(3)
    with pytest.raises(ValueError, match="is free: allocate it first"):
        pool.incref(1)
    block = pool.allocate()
    with pytest.raises(ValueError, match="still has 1 reference"):
        pool.free(block)
    with pytest.raises(ValueError, match="at least 1"):
        BlockAllocator(Device.GPU, 0, reserve_null_block=True)
