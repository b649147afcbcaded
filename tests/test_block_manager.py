"""BlockManager: one test per operation and per error, with invariants checked throughout."""

from __future__ import annotations

import itertools

import pytest

from paged_jax.memory import NULL_BLOCK, AllocStatus, BlockManager, NoFreeBlocksError
from paged_jax.memory import prefix_cache
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()


def make_group(prompt: list[int], n: int = 1, output: tuple[int, ...] = ()) -> SequenceGroup:
    seqs = [Sequence(next(_ids), list(prompt), output_token_ids=list(output)) for _ in range(n)]
    return SequenceGroup(f"req-{seqs[0].seq_id}", seqs)


def admit(bm: BlockManager, prompt: list[int], n: int = 1, compute: bool = True) -> SequenceGroup:
    """Allocate a new request, run it and (optionally) compute and mark its prompt."""
    group = make_group(prompt, n)
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
        if compute:
            seq.num_computed_tokens = seq.get_len()
            bm.mark_blocks_computed(seq)
    bm.check_invariants()
    return group


def grow(bm: BlockManager, seq: Sequence, *tokens: int):
    for t in tokens:
        seq.append_token_id(t)
    copy = bm.append_slot(seq)
    seq.num_computed_tokens = seq.get_len()
    bm.mark_blocks_computed(seq)
    bm.check_invariants()
    return copy


def refs(bm: BlockManager, seq: Sequence) -> list[int]:
    return [bm.gpu_allocator.get_ref_count(b) for b in bm.get_block_table(seq)]


# ---- counting and admission ---------------------------------------------------------
def test_null_block_is_reserved_and_not_counted():
    bm = BlockManager(block_size=4, num_gpu_blocks=5, num_cpu_blocks=2, watermark=0.0)
    assert bm.get_num_free_gpu_blocks() == 4 and bm.get_usage().num_total_gpu_blocks == 4
    group = admit(bm, list(range(16)))
    assert NULL_BLOCK not in bm.get_block_table(group.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 0
    assert bm.can_allocate(make_group([1])) is AllocStatus.LATER


def test_can_allocate_never_later_ok_with_watermark():
    bm = BlockManager(block_size=4, num_gpu_blocks=11, num_cpu_blocks=0, watermark=0.1)
    assert bm.watermark_blocks == 1  # 10 usable blocks
    assert bm.can_allocate(make_group(list(range(40)))) is AllocStatus.NEVER  # 10 blocks > 10 - 1
    assert bm.can_allocate(make_group(list(range(36)))) is AllocStatus.OK  # 9 blocks, 1 left
    admit(bm, [7] * 8)  # 2 blocks used
    assert bm.can_allocate(make_group(list(range(36)))) is AllocStatus.LATER
    assert bm.can_allocate(make_group(list(range(28)))) is AllocStatus.OK  # 7 blocks, watermark kept
    assert bm.can_allocate(make_group(list(range(29)))) is AllocStatus.LATER


def test_can_allocate_counts_generated_tokens_after_recompute():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0, watermark=0.0)
    group = make_group([1, 2, 3, 4], output=(5,))  # 5 tokens: 2 blocks, fits exactly
    assert bm.can_allocate(group) is AllocStatus.OK
    assert bm.can_allocate(make_group([1, 2, 3, 4], output=(5, 6, 7, 8, 9))) is AllocStatus.NEVER
    bm.allocate(group)
    assert len(bm.get_block_table(group.seqs[0])) == 2


# ---- allocate -----------------------------------------------------------------------
def test_allocate_shares_blocks_among_waiting_seqs():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    group = make_group(list(range(10)), n=3)
    bm.allocate(group)
    tables = {tuple(bm.get_block_table(s)) for s in group.seqs}
    assert len(tables) == 1 and len(next(iter(tables))) == 3
    assert refs(bm, group.seqs[0]) == [3, 3, 3]
    assert all(s.num_computed_tokens == 0 and bm.has_seq(s) for s in group.seqs)
    assert bm.get_num_free_gpu_blocks() == 7 - 3
    bm.check_invariants()


def test_allocate_diverged_siblings_share_common_full_blocks():
    """A multi-sample request recomputed after preemption: each sequence gets its own
    tokens' blocks; leading full blocks with the same tokens are shared, the rest owned."""
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0)
    prompt = list(range(10, 19))  # 9 tokens: two full blocks and one token
    group = make_group(prompt, n=4)
    for seq, out in zip(group.seqs, ([1, 2, 3], [1, 2, 4], [1, 2, 3], [5])):
        seq.output_token_ids.extend(out)
    # Blocks: [10..13] [14..17] [18,1,2,3|4] / [18,5]; seqs 0 and 2 are identical.
    assert bm.plan_allocation(group).num_blocks_taken == 2 + 1 + 1 + 1
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert tables[0] == tables[2]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
    assert len({t[2] for t in tables}) == 3
    assert bm.get_num_free_gpu_blocks() == 15 - 5
    assert all(s.num_computed_tokens == 0 for s in group.seqs)
    bm.check_invariants()
    for seq in group.seqs:
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 15
    bm.check_invariants()


def test_recomputed_siblings_count_each_cached_block_once():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(10, 26))  # 4 full blocks, computed, registered, then freed: evictable
    first = admit(bm, prompt)
    bm.mark_blocks_computed(first.seqs[0])
    bm.free(first.seqs[0])
    group = make_group(prompt, n=2)
    group.seqs[0].output_token_ids.extend([1, 2, 3])
    group.seqs[1].output_token_ids.extend([4, 5, 6])
    assert bm.plan_allocation(group).num_blocks_taken == 4 + 2  # the 4 cached blocks once, one tail block each
    assert bm.get_num_free_gpu_blocks() == 7 and bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert bm.get_num_free_gpu_blocks() == 1
    assert all(s.num_computed_tokens == 16 for s in group.seqs)
    bm.check_invariants()


def test_can_allocate_counts_what_allocate_takes_without_the_prefix_cache():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(10, 26))  # 4 full blocks, computed and registered, still in use
    admit(bm, prompt)
    group = make_group(prompt + [99])  # 5 blocks, the first 4 in the cache
    assert bm.get_num_free_gpu_blocks() == 3
    assert bm.plan_allocation(group).num_blocks_taken == 1
    assert bm.can_allocate(group) is AllocStatus.OK
    assert bm.plan_allocation(group, use_prefix_cache=False).num_blocks_taken == 5
    assert bm.can_allocate(group, use_prefix_cache=False) is AllocStatus.LATER
    with pytest.raises(NoFreeBlocksError, match="allocate needs 5 free blocks in the gpu pool, 3 are free"):
        bm.allocate(group, use_prefix_cache=False)
    bm.check_invariants()


def test_allocate_errors_leave_state_unchanged():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0, watermark=0.0)
    with pytest.raises(NoFreeBlocksError, match="allocate needs 3 free blocks in the gpu pool, 2 are free"):
        bm.allocate(make_group(list(range(9))))
    assert bm.get_num_free_gpu_blocks() == 2
    bm.check_invariants()
    group = admit(bm, [1, 2])
    with pytest.raises(ValueError, match="no waiting sequence"):
        bm.allocate(group)
    group.seqs[0].status = SequenceStatus.WAITING
    with pytest.raises(ValueError, match="already has a block table"):
        bm.allocate(group)
    bm.check_invariants()


# ---- append_slot and copy-on-write -------------------------------------------------
def test_append_slot_adds_a_block_only_when_the_last_is_full():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    seq = admit(bm, [1, 2, 3]).seqs[0]
    assert grow(bm, seq, 4) is None and len(bm.get_block_table(seq)) == 1
    assert grow(bm, seq, 5) is None and len(bm.get_block_table(seq)) == 2
    assert grow(bm, seq, *range(9)) is None and len(bm.get_block_table(seq)) == 4  # 14 tokens: several slots
    assert bm.append_slot(seq) is None  # already covered


def test_append_slot_copy_on_write_after_fork():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    group = admit(bm, [1, 2, 3, 4, 5])
    parent = group.seqs[0]
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    group.add(child)
    assert bm.get_block_table(child) == bm.get_block_table(parent) and refs(bm, parent) == [2, 2]
    shared_last = bm.get_block_table(parent)[-1]
    assert bm.can_append_slots(group)
    src, dst = grow(bm, parent, 6)
    assert src == shared_last and dst not in bm.get_block_table(child)
    assert bm.get_block_table(parent) == [bm.get_block_table(child)[0], dst]
    assert refs(bm, parent) == [2, 1] and refs(bm, child) == [2, 1]
    assert grow(bm, child, 7) is None  # the last holder writes in place
    assert bm.get_block_table(child)[-1] == shared_last


def test_fork_without_sharing_copies_every_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, enable_block_sharing=False)
    group = admit(bm, [1, 2, 3, 4, 5])
    parent = group.seqs[0]
    child = parent.fork(next(_ids))
    copies = bm.fork(parent, child)
    group.add(child)
    assert [src for src, _ in copies] == bm.get_block_table(parent)
    assert [dst for _, dst in copies] == bm.get_block_table(child)
    assert not set(bm.get_block_table(parent)) & set(bm.get_block_table(child))
    assert refs(bm, parent) == [1, 1] and refs(bm, child) == [1, 1]
    assert grow(bm, parent, 6) is None  # nothing shared: no copy-on-write
    bm.check_invariants()
    with pytest.raises(ValueError, match="needs enable_block_sharing"):
        BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, enable_prefix_caching=True,
                     enable_block_sharing=False)


def test_copy_on_write_then_growth_past_the_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    group = admit(bm, [1, 2, 3], n=2)
    a, b = group.seqs
    shared = bm.get_block_table(a)[0]
    assert grow(bm, a, 4, 5, 6)[0] == shared  # tokens 3..5 go into the shared block's copy and a new one
    assert len(bm.get_block_table(a)) == 2 and refs(bm, b) == [1]


def test_can_append_slots_counts_new_and_copied_blocks_exactly():
    bm = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    group = admit(bm, [1, 2], n=3)  # one shared partial block, 2 free
    for seq in group.seqs:
        seq.append_token_id(3)
    assert bm.can_append_slots(group)  # 3 writers, refcount 3: 2 copies
    admit(bm, [9])  # 1 free
    assert not bm.can_append_slots(group)
    with pytest.raises(NoFreeBlocksError):
        for seq in group.seqs:
            bm.append_slot(seq)
    bm.check_invariants()


def test_append_slot_errors():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0)
    seq = admit(bm, [1, 2, 3, 4]).seqs[0]
    with pytest.raises(KeyError, match="no block table"):
        bm.append_slot(Sequence(next(_ids), [1]))
    seq.output_token_ids.extend([5] * 5)
    with pytest.raises(NoFreeBlocksError, match="append_slot needs 2"):
        bm.append_slot(seq)
    del seq.output_token_ids[:]
    bm.append_slot(seq)
    seq.prompt_token_ids = [1]
    with pytest.raises(ValueError, match="fewer than the 4"):
        bm.append_slot(seq)


# ---- fork and free --------------------------------------------------------------------
def test_fork_and_free_refcounts():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    parent = admit(bm, list(range(6))).seqs[0]
    children = [Sequence(next(_ids), []) for _ in range(3)]
    for child in children:
        bm.fork(parent, child)
    assert refs(bm, parent) == [4, 4]
    with pytest.raises(ValueError, match="already has a block table"):
        bm.fork(parent, children[0])
    bm.free(parent)
    assert not bm.has_seq(parent) and refs(bm, children[0]) == [3, 3]
    bm.free(parent)  # no table: a no-op
    for child in children:
        bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 7 and bm.gpu_allocator.num_used_blocks == 0
    bm.check_invariants()


# ---- swapping ---------------------------------------------------------------------------
def forked_group(bm: BlockManager) -> SequenceGroup:
    """Two seqs sharing their first block, each with its own second block."""
    group = admit(bm, list(range(6)))
    child = group.seqs[0].fork(next(_ids))
    bm.fork(group.seqs[0], child)
    group.add(child)
    grow(bm, group.seqs[0], 100)
    grow(bm, child, 200)
    return group


def test_swap_out_and_in_preserve_sharing_and_refcounts():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    group = forked_group(bm)
    a, b = group.seqs
    before = [bm.get_block_table(s) for s in group.seqs]
    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    assert set(out) == {before[0][0], before[0][1], before[1][1]}  # the shared block once
    assert [bm.get_block_table(s) for s in group.seqs] == [[out[x] for x in t] for t in before]
    assert bm.cpu_allocator.get_ref_count(out[before[0][0]]) == 2
    assert bm.get_num_free_gpu_blocks() == 7 and a.status is SequenceStatus.RUNNING  # statuses are the caller's
    bm.check_invariants()
    with pytest.raises(ValueError, match="cpu pool, not the gpu pool"):
        bm.append_slot(a)
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(group)
    back = bm.swap_in(group)
    assert set(back) == set(out.values())
    after = [bm.get_block_table(s) for s in group.seqs]
    assert after[0][0] == after[1][0] and len(set(after[0] + after[1])) == 3
    assert refs(bm, a) == [2, 1] and refs(bm, b) == [2, 1]
    assert bm.get_num_free_cpu_blocks() == 8
    bm.check_invariants()


def test_swap_checks_space():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=2, watermark=0.0)
    group = forked_group(bm)
    assert not bm.can_swap_out(group)
    with pytest.raises(NoFreeBlocksError, match="cpu pool"):
        bm.swap_out(group)
    bm.check_invariants()


def test_can_swap_in_reserves_blocks_for_pending_tokens_and_watermark():
    bm = BlockManager(block_size=4, num_gpu_blocks=5, num_cpu_blocks=4, watermark=0.0)
    group = admit(bm, [1, 2, 3, 4])
    seq = group.seqs[0]
    bm.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    seq.append_token_id(5)  # sampled before the preemption: needs a new block after swap-in
    admit(bm, list(range(9)))  # 3 blocks: 1 free
    assert not bm.can_swap_in(group)  # 1 block to swap in + 1 for token 5 > 1 free
    bm2 = BlockManager(block_size=4, num_gpu_blocks=5, num_cpu_blocks=4, watermark=0.3)  # watermark 1 block
    group2 = admit(bm2, [1, 2, 3, 4])
    bm2.swap_out(group2)
    group2.seqs[0].status = SequenceStatus.SWAPPED
    admit(bm2, list(range(8)))  # 2 free: 1 to swap in + 1 watermark
    assert bm2.can_swap_in(group2)
    group2.seqs[0].append_token_id(5)
    assert not bm2.can_swap_in(group2)


def test_swap_out_of_blocks_shared_with_another_group():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0,
                      enable_prefix_caching=True)
    first = admit(bm, list(range(9)))
    second = admit(bm, list(range(9)) + [50])
    shared = bm.get_block_table(first.seqs[0])[:2]
    assert bm.get_block_table(second.seqs[0])[:2] == shared
    out = bm.swap_out(second)
    assert set(shared) <= set(out)  # copied for the host, still used on the device
    assert [bm.gpu_allocator.get_ref_count(b) for b in shared] == [1, 1]
    bm.check_invariants()


def test_swapped_in_blocks_are_registered_again_once_marked():
    bm = BlockManager(block_size=2, num_gpu_blocks=6, num_cpu_blocks=4, watermark=0.0,
                      enable_prefix_caching=True)
    group = admit(bm, [1, 2, 3, 4, 5])
    seq = group.seqs[0]
    bm.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    assert bm.reset_prefix_cache() == 2  # the device copies of the full blocks are gone
    bm.swap_in(group)
    seq.status = SequenceStatus.RUNNING
    bm.mark_blocks_computed(seq)
    hit = admit(bm, [1, 2, 3, 4, 9], compute=False).seqs[0]
    assert hit.num_computed_tokens == 4 and bm.get_block_table(hit)[:2] == bm.get_block_table(seq)[:2]


# ---- automatic prefix caching ------------------------------------------------------------
def test_prefix_hit_only_after_blocks_are_computed():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=True)
    a = admit(bm, list(range(10)), compute=False).seqs[0]
    b = make_group(list(range(10)))
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0  # nothing registered at allocation
    a.num_computed_tokens = 6  # a chunk: only block 0 is computed
    bm.mark_blocks_computed(a)
    c = admit(bm, list(range(12)), compute=False).seqs[0]
    assert c.num_computed_tokens == 4 and bm.get_block_table(c)[0] == bm.get_block_table(a)[0]
    a.num_computed_tokens = 10
    bm.mark_blocks_computed(a)
    d = admit(bm, list(range(12)), compute=False).seqs[0]
    assert d.num_computed_tokens == 8 and bm.get_block_table(d)[:2] == bm.get_block_table(a)[:2]
    assert refs(bm, d)[:2] == [3, 2]


def test_prefix_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=True)
    a = admit(bm, list(range(8))).seqs[0]
    b = admit(bm, list(range(8)), compute=False).seqs[0]
    assert b.num_computed_tokens == 4  # not 8: the logits need one computed token
    assert bm.get_block_table(b)[0] == bm.get_block_table(a)[0]
    assert bm.get_block_table(b)[1] != bm.get_block_table(a)[1]


def test_decode_blocks_are_cached_and_recompute_hits_them():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=True)
    group = admit(bm, [1, 2, 3])
    seq = group.seqs[0]
    grow(bm, seq, 4)
    grow(bm, seq, 5)
    grow(bm, seq, 6)
    blocks = bm.get_block_table(seq)
    bm.free(seq)  # preempted by recompute
    seq.reset_for_recompute()
    bm.allocate(group)
    assert seq.num_computed_tokens == 4 and bm.get_block_table(seq)[0] == blocks[0]
    bm.check_invariants()


def test_prefix_miss_without_caching_and_on_other_prefix():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0)
    admit(bm, list(range(9)))
    assert admit(bm, list(range(9)), compute=False).seqs[0].num_computed_tokens == 0
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=True)
    admit(bm, list(range(9)))
    # Same second block, different first block: the chained hash tells them apart.
    assert admit(bm, [9, 9, 9, 9, 4, 5, 6, 7, 8], compute=False).seqs[0].num_computed_tokens == 0


def test_hash_collisions_are_verified(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, tokens: b"same")
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=True)
    admit(bm, [1, 2, 3, 4, 5])
    assert admit(bm, [5, 6, 7, 8, 9], compute=False).seqs[0].num_computed_tokens == 0
    assert admit(bm, [1, 2, 3, 4, 9], compute=False).seqs[0].num_computed_tokens == 4


def test_freed_cached_blocks_are_evictable_lru_and_count_as_free():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0,
                      enable_prefix_caching=True)
    old = admit(bm, [1, 1, 1, 1, 0]).seqs[0]  # blocks: [1 1] [1 1] [0]
    new = admit(bm, [2, 2, 0]).seqs[0]  # [2 2] [0]
    old_blocks, new_blocks = bm.get_block_table(old), bm.get_block_table(new)
    bm.free(old)
    bm.free(new)
    usage = bm.get_usage()
    assert usage.num_used_gpu_blocks == 0 and usage.num_cached_gpu_blocks == 3  # the full blocks
    assert bm.get_num_free_gpu_blocks() == 7 and bm.gpu_allocator.num_free_blocks == 4
    # Four fresh blocks come from the free list, the fifth evicts the least recently
    # used cached block: old's tail (a sequence is released tail first).
    filler = admit(bm, [7] * 9, compute=False).seqs[0]
    assert old_blocks[1] in bm.get_block_table(filler)
    assert not {old_blocks[0], new_blocks[0]} & set(bm.get_block_table(filler))
    bm.free(filler)
    assert admit(bm, [1, 1, 1, 1, 5], compute=False).seqs[0].num_computed_tokens == 2  # head still cached
    assert admit(bm, [2, 2, 5], compute=False).seqs[0].num_computed_tokens == 2


def test_cache_hit_on_evictable_block_revives_it():
    bm = BlockManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0,
                      enable_prefix_caching=True)
    bm.free(admit(bm, [1, 2, 3]).seqs[0])
    assert bm.get_num_free_gpu_blocks() == 3
    group = make_group([1, 2, 3, 4, 5])  # 3 blocks: revives 1 cached block + 2 fresh
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert group.seqs[0].num_computed_tokens == 2 and bm.get_num_free_gpu_blocks() == 0
    bm.check_invariants()


def test_reset_prefix_cache():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=0, enable_prefix_caching=True)
    bm.free(admit(bm, [1, 2, 3, 4, 5]).seqs[0])
    assert bm.reset_prefix_cache() == 2
    assert bm.gpu_allocator.num_free_blocks == 7 and bm.get_usage().num_cached_gpu_blocks == 0
    assert admit(bm, [1, 2, 3, 4, 5], compute=False).seqs[0].num_computed_tokens == 0


# ---- pinned shared prefixes -------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_pin_prefix_is_found_and_survives_until_unpinned(caching):
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0,
                      enable_prefix_caching=caching)
    prefix = admit(bm, list(range(10))).seqs[0]  # 2 full blocks + 2 tokens
    handle = bm.pin_prefix(prefix)
    pinned = bm.get_pinned_blocks(handle)
    assert pinned == bm.get_block_table(prefix)[:2]
    bm.free(prefix)
    assert [bm.gpu_allocator.get_ref_count(b) for b in pinned] == [1, 1]
    assert bm.get_num_free_gpu_blocks() == 5  # pinned blocks are neither free nor evictable
    user = admit(bm, list(range(8)) + [42, 43], compute=False).seqs[0]
    assert user.num_computed_tokens == 8 and bm.get_block_table(user)[:2] == pinned
    bm.free(user)
    bm.unpin_prefix(handle)
    bm.check_invariants()
    assert bm.get_usage().num_used_gpu_blocks == 0
    expected_hit = 8 if caching else 0  # unpinned: cached only with automatic caching
    assert admit(bm, list(range(9)), compute=False).seqs[0].num_computed_tokens == expected_hit
    with pytest.raises(ValueError, match="no pinned prefix"):
        bm.unpin_prefix(handle)


def test_two_pins_of_one_prefix_share_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    first = admit(bm, list(range(8))).seqs[0]
    second = admit(bm, list(range(8))).seqs[0]  # computed separately: its own blocks
    h1, h2 = bm.pin_prefix(first), bm.pin_prefix(second)
    assert bm.get_pinned_blocks(h1) == bm.get_pinned_blocks(h2) == bm.get_block_table(first)
    bm.unpin_prefix(h1)
    assert admit(bm, list(range(9)), compute=False).seqs[0].num_computed_tokens == 8  # h2 still pins
    assert bm.pin_prefix(admit(bm, [1, 2]).seqs[0]) is not None  # shorter than a block: pins nothing
    bm.check_invariants()


# ---- usage and invariant checking ---------------------------------------------------------------
def test_usage_counts_shared_tokens_once():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0)
    group = admit(bm, list(range(6)), n=4)  # 2 blocks shared by 4 seqs
    usage = bm.get_usage()
    assert (usage.num_used_gpu_blocks, usage.num_tokens_stored, usage.num_token_slots_used) == (2, 6, 8)
    grow(bm, group.seqs[0], 9)  # copy-on-write: 3 blocks, 4 + 2 + 3 tokens
    usage = bm.get_usage()
    assert (usage.num_used_gpu_blocks, usage.num_tokens_stored) == (3, 9)
    assert usage.utilization == 9 / 12


def test_check_invariants_detects_a_broken_refcount():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    seq = admit(bm, list(range(6))).seqs[0]
    bm.gpu_allocator.incref(bm.get_block_table(seq)[0])
    with pytest.raises(AssertionError, match="reference count 2, held 1 times"):
        bm.check_invariants()
