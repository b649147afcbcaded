"""The block manager of a model with several layer groups (``layer_groups``): one block table per
sequence per group, every group's blocks from one device pool of same-sized pages.

Each group is a :class:`BlockManager` of its own tables (and its own sliding window, by which its
leading blocks are freed as Mistral's are), all sharing one device pool, one host pool and one
prefix cache; so every operation (admission, growth with copy-on-write, forks, rollback, swap,
recompute, pins) is the one-group operation applied to each group, and what it takes is the sum
of what each group takes, checked against the shared pool before anything changes. Groups never
share a block: a copy or a swap moves pages by id and is right for whichever group holds them.
Prefix caching keys each group's blocks under a hash chain of its own, and a prefix hit needs
every group's blocks: admission reuses the leading blocks that all groups have cached.

Given the scheduler's ``max_num_batched_tokens``, the windowed groups take a prompt's blocks chunk
by chunk (``block_manager``): admission takes the full-attention groups' blocks for the whole prompt
and the windowed groups' for its first chunk, and each later chunk's growth frees the blocks its
window has passed before it takes new ones (counted net by ``can_append_slots``), so a windowed
group never holds more than its window's blocks and a chunk's.

Invariants (``check_invariants``), beside each group's own (``block_manager``):

- A sequence has a table in every group or in none, all in one pool; the full-attention groups'
  tables cover the sequence's tokens, a windowed group's at most as many (while a prompt is computed,
  only up to the current chunk).
- No block is held by two groups; a block's reference count is the number of tables of all
  groups, plus pins, holding it; free + used + evictable-cached = total in the shared pools.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Optional

from paged_jax.memory.block_allocator import NULL_BLOCK, Device, NoFreeBlocksError
from paged_jax.memory.block_manager import AllocStatus, BlockManager
from paged_jax.memory.block_pool import KVCacheUsage
from paged_jax.memory.block_table import blocks_for, plan_growth
from paged_jax.memory.layer_groups import KVLayout
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus


class GroupBlockTables(list):
    """A sequence's block tables, one per layer group, each padded with the null block to the longest
    (a windowed group's covers only the current chunk of a prompt): as a list, group 0's blocks (what a
    reader of one table sees: every group's table has as many entries); ``per_group``: each group's."""

    def __init__(self, per_group: list[list[int]]) -> None:
        n = max(map(len, per_group))
        self.per_group = [t + [NULL_BLOCK] * (n - len(t)) for t in per_group]
        super().__init__(self.per_group[0])


@dataclass(frozen=True)
class HybridAllocationPlan:
    plans: list  # each group's AllocationPlan
    num_blocks_taken: int
    num_blocks_uncached: int


class HybridBlockManager:
    """``windows``: each group's sliding window (None: full attention), as ``KVLayout.windows``.
    ``max_num_batched_tokens``: the scheduler's budget, the most tokens a step computes of one
    sequence; given, the windowed groups take a prompt's blocks chunk by chunk (None: all at admission)."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, windows: Seq[Optional[int]],
                 watermark: float = 0.01, enable_prefix_caching: bool = False,
                 enable_block_sharing: bool = True, max_num_batched_tokens: Optional[int] = None) -> None:
        if len(windows) < 2:
            raise ValueError(f"a hybrid block manager needs at least two layer groups, got windows {list(windows)}")
        first = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark, enable_prefix_caching,
                             enable_block_sharing, sliding_window=windows[0], max_num_batched_tokens=(
                                 None if windows[0] is None else max_num_batched_tokens))
        self.groups = [first]
        for g, window in enumerate(windows[1:], 1):
            if window is not None and (not isinstance(window, int) or window < 1):
                raise ValueError(f"sliding_window must be None or a positive integer, got {window!r}")
            group = copy.copy(first)  # shares the pools and the prefix cache
            group._tables, group.sliding_window, group._hash_root = {}, window, b"layer group %d" % g
            group.max_num_batched_tokens = None if window is None else max_num_batched_tokens  # full: whole prompt
            self.groups.append(group)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.windows = tuple(windows)
        self.block_size, self.watermark_blocks = block_size, first.watermark_blocks
        self.enable_prefix_caching, self.enable_block_sharing = enable_prefix_caching, enable_block_sharing
        self.gpu_allocator, self.cpu_allocator, self.gpu_pool = first.gpu_allocator, first.cpu_allocator, first.gpu_pool
        self._pins: dict[int, list[int]] = {}  # handle -> each group's pin handle
        self._next_pin = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # ---- admission -------------------------------------------------------------------
    def _lookups(self, seq_group: SequenceGroup, use_prefix_cache: bool) -> list:
        """Each group's prefix lookup, cut to the leading blocks every group has cached."""
        if not use_prefix_cache:
            return [None] * self.num_groups
        hits: dict[tuple[int, ...], list] = {}
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            tokens = tuple(seq.get_token_ids())
            if tokens not in hits:
                found = [g._match_prefix(list(tokens)) for g in self.groups]
                n = min(len(blocks) for blocks, _ in found)
                hits[tokens] = [(blocks[:n], hashes[:n]) for blocks, hashes in found]
        return [lambda tokens, g=g: hits[tuple(tokens)][g] for g in range(self.num_groups)]

    def plan_allocation(self, seq_group: SequenceGroup, use_prefix_cache: bool = True,
                        reserve_tokens: int = 0) -> HybridAllocationPlan:
        lookups = self._lookups(seq_group, use_prefix_cache)
        plans = [g.plan_allocation(seq_group, use_prefix_cache, reserve_tokens, lookup)
                 for g, lookup in zip(self.groups, lookups)]
        return HybridAllocationPlan(plans, sum(p.num_blocks_taken for p in plans),
                                    sum(p.num_blocks_uncached for p in plans))

    def can_allocate(self, seq_group: SequenceGroup, reserve_tokens: int = 0,
                     use_prefix_cache: bool = True) -> AllocStatus:
        return self.groups[0].admission(self.plan_allocation(seq_group, use_prefix_cache, reserve_tokens))

    def allocate(self, seq_group: SequenceGroup, use_prefix_cache: bool = True, reserve_tokens: int = 0) -> None:
        lookups = self._lookups(seq_group, use_prefix_cache)
        plans = [g.plan_allocation(seq_group, use_prefix_cache, reserve_tokens, lookup)
                 for g, lookup in zip(self.groups, lookups)]
        self.gpu_pool.ensure_free(sum(p.num_blocks_taken for p in plans), "allocate")
        # Hold every group's cached hits first: a group's fresh blocks may evict another's unreferenced hits.
        held = [b for plan in plans for s in plan.seqs for b in s.cached]
        self.gpu_pool.incref_all(held)
        for group, lookup in zip(self.groups, lookups):
            group.allocate(seq_group, use_prefix_cache, reserve_tokens, lookup)
        self.gpu_pool.release_all(held)

    # ---- growth -------------------------------------------------------------------------
    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether ``append_slots`` covers every RUNNING sequence: of one sequence, counting the blocks
        its windows free first (a prompt's next chunk takes about as many as the window frees); of
        several, not (one's block shared with a sibling is only freed by the last to release it)."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        need = sum(g._num_growth_blocks(seqs, Device.GPU) for g in self.groups)
        if len(seqs) == 1:
            need -= sum(g._num_freed_by_window(seqs[0]) for g in self.groups)
        return need <= self.get_num_free_gpu_blocks()

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Every group's ``append_slot``: the copy-on-write copies, one per group at most. Every
        group frees the blocks its window has passed first (always allowed), then the growth is
        checked against the pool before any group grows."""
        for g in self.groups:
            g._free_outside_window(seq, g._table(seq, Device.GPU))
        need = sum(g._num_growth_blocks([seq], Device.GPU) for g in self.groups)
        self.gpu_pool.ensure_free(need, "append_slot")
        return [c for g in self.groups for c in g.append_slots(seq)]

    def append_slot(self, seq: Sequence) -> Optional[tuple[int, int]]:
        """``append_slots`` for a caller expecting one copy at most (a table already grown this step
        copies nothing); ValueError, before any change, if several groups would copy."""
        tables = [(g, g._table(seq, Device.GPU)) for g in self.groups]
        copies = sum(plan_growth(t, g._tokens_to_hold(seq, t), self.block_size, self.gpu_allocator.get_ref_count)
                     .copy_last for g, t in tables)
        if copies > 1:
            raise ValueError(f"sequence {seq.seq_id}: {copies} layer groups copy their last block; use append_slots")
        copies = self.append_slots(seq)
        return copies[0] if copies else None

    def rollback(self, seq: Sequence, num_tokens: Optional[int] = None) -> None:
        for group in self.groups:
            group.rollback(seq, num_tokens)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> list[tuple[int, int]]:
        if not self.enable_block_sharing:
            self.gpu_pool.ensure_free(len(self._distinct_blocks([parent_seq])), "fork")
        return [c for g in self.groups for c in g.fork(parent_seq, child_seq)]

    def free(self, seq: Sequence) -> None:
        for group in self.groups:
            group.free(seq)

    # ---- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return len(self._distinct_blocks(seqs)) <= self.cpu_allocator.num_free_blocks

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        if not self.can_swap_out(seq_group):
            raise NoFreeBlocksError(f"swap to cpu of request {seq_group.request_id!r}: too few free host blocks")
        return {src: dst for g in self.groups for src, dst in g.swap_out(seq_group).items()}

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        need = len(self._distinct_blocks(seqs)) + sum(g._num_growth_blocks(seqs, Device.CPU) for g in self.groups)
        return self.get_num_free_gpu_blocks() - need >= self.watermark_blocks

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        self.gpu_pool.ensure_free(len(self._distinct_blocks(seqs)), "swap to gpu")
        return {src: dst for g in self.groups for src, dst in g.swap_in(seq_group).items()}

    # ---- prefix sharing ------------------------------------------------------------------------
    def mark_blocks_computed(self, seq: Sequence) -> None:
        for group in self.groups:
            group.mark_blocks_computed(seq)

    def pin_prefix(self, seq: Sequence) -> int:
        for group in self.groups:
            if group._table(seq, Device.GPU).num_freed:
                raise ValueError(f"sequence {seq.seq_id}: its leading blocks are freed (past a sliding window); "
                                 "a prefix to pin must be shorter than the window")
        handle, self._next_pin = self._next_pin, self._next_pin + 1
        self._pins[handle] = [group.pin_prefix(seq) for group in self.groups]
        return handle

    def unpin_prefix(self, handle: int) -> None:
        if handle not in self._pins:
            raise ValueError(f"no pinned prefix with handle {handle}")
        for group, h in zip(self.groups, self._pins.pop(handle)):
            group.unpin_prefix(h)

    def get_pinned_blocks(self, handle: int) -> list[int]:
        """Every group's pinned blocks, group after group."""
        return [b for group, h in zip(self.groups, self._pins[handle]) for b in group.get_pinned_blocks(h)]

    def reset_prefix_cache(self) -> int:
        return self.groups[0].reset_prefix_cache()

    # ---- queries ---------------------------------------------------------------------------------
    def has_seq(self, seq: Sequence) -> bool:
        return self.groups[0].has_seq(seq)

    def get_block_table(self, seq: Sequence, group: Optional[int] = None) -> list[int]:
        """Group ``group``'s table, or (None) every group's as :class:`GroupBlockTables`."""
        if group is not None:
            return self.groups[group].get_block_table(seq)
        return GroupBlockTables([g.get_block_table(seq) for g in self.groups])

    def get_num_freed_blocks(self, seq: Sequence, group: int = 0) -> int:
        return self.groups[group].get_num_freed_blocks(seq)

    def get_num_free_gpu_blocks(self) -> int:
        return self.groups[0].get_num_free_gpu_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.groups[0].get_num_free_cpu_blocks()

    def num_blocks_needed(self, prompt_len: int, total_len: int) -> int:
        """Device blocks one sequence needs at most: while its prompt is computed, the full-attention
        groups' for the whole prompt and the windowed groups' for their window and a chunk (without
        ``max_num_batched_tokens``: the whole prompt); at ``total_len`` tokens, the full-attention
        groups' all and the windowed groups' window."""
        bs, h = self.block_size, self.max_num_batched_tokens
        prompt = blocks_for(prompt_len, bs)
        start = sum(prompt if w is None or h is None else min(prompt, blocks_for(w + h + bs - 1, bs))
                    for w in self.windows)
        end = sum(blocks_for(total_len, bs) if w is None else min(blocks_for(total_len, bs), -(-w // bs) + 1)
                  for w in self.windows)
        return max(start, end)

    def get_usage(self) -> KVCacheUsage:
        """The shared device pool's usage: a token held in several groups' blocks counts in each."""
        fill, reserved = {}, 0
        for group in self.groups:
            f, r = group._fill()
            fill.update(f)
            reserved += r
        fill.update((block, self.block_size) for block in self.gpu_pool.pinned_blocks())
        used = self.gpu_allocator.num_used_blocks
        return KVCacheUsage(self.gpu_allocator.num_total_blocks, used, self.gpu_pool.cache.num_evictable,
                            sum(fill.values()), used * self.block_size, reserved)

    def get_group_usage(self) -> list[int]:
        """Device blocks each group's tables hold (a block shared by several tables counts once)."""
        return [len({b for t in g._tables.values() if t.device is Device.GPU for b in t.live_blocks})
                for g in self.groups]

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of this module's or ``block_manager``'s docstring is broken."""
        refs = {Device.GPU: Counter(), Device.CPU: Counter()}
        owner: dict[tuple[Device, int], int] = {}
        first = self.groups[0]._tables
        for g, group in enumerate(self.groups):
            _require(group._tables.keys() == first.keys(), f"layer group {g} has tables for other sequences")
            for seq_id, table in group._tables.items():
                most = max(other._tables[seq_id].num_tokens for other in self.groups)
                _require(table.device is first[seq_id].device, f"sequence {seq_id}: group {g}'s table is in "
                                                                f"another pool than group 0's")
                _require(table.num_tokens == most or (group.max_num_batched_tokens and table.num_tokens < most),
                         f"sequence {seq_id}: group {g}'s table covers {table.num_tokens} tokens, another group's "
                         f"{most}; only a windowed group's may cover fewer (a prompt's chunk)")
                for block in table.live_blocks:
                    _require(owner.setdefault((table.device, block), g) == g,
                             f"{table.device.value} block {block} is held by layer groups {owner[table.device, block]} "
                             f"and {g}")
            for device, counts in group._check_tables().items():
                refs[device] += counts
        self.groups[0]._check_pools(refs)

    def _distinct_blocks(self, seqs: list[Sequence]) -> set[int]:
        return {b for g in self.groups for b in g._distinct_blocks(seqs)}


def make_block_manager(layout: KVLayout, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                       max_num_batched_tokens: Optional[int] = None, **kwargs):
    """The block manager for ``layout``: one group's :class:`BlockManager` (freeing by its window), or a
    :class:`HybridBlockManager` of several, its windowed groups taking a prompt's blocks chunk by chunk of
    ``max_num_batched_tokens`` (the scheduler's). ``kwargs``: watermark, enable_prefix_caching,
    enable_block_sharing."""
    if layout.num_groups == 1:
        return BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, sliding_window=layout.windows[0], **kwargs)
    return HybridBlockManager(block_size, num_gpu_blocks, num_cpu_blocks, layout.windows,
                              max_num_batched_tokens=max_num_batched_tokens, **kwargs)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
