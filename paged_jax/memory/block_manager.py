"""The block manager: maps each sequence's tokens to physical KV cache blocks.

Plain Python, no JAX. The scheduler asks it what fits (``can_*``) and tells it
what to do; the operations that move data return plans (copy-on-write pairs,
swap mappings) that the executor carries out with ``cache_ops`` before the step.
What an operation takes is counted once, by the plans of ``block_table``, for
both the question and the operation; the blocks themselves (reference counts,
the prefix cache's evictable blocks, pins) are the pools' (``block_pool``).

Every sequence with blocks has a *block table*: its blocks in token order, on
the device pool (running) or the host pool (swapped), and how many tokens they
hold (``seq.get_len()`` at the last ``allocate`` / ``append_slot``). Invariants
(``check_invariants`` verifies them; the tests call it after every operation):

- A block's reference count equals the number of block tables holding it, plus
  the prefix pins holding it (device pool). No table holds a free block.
- Per pool, free + used + evictable-cached = total; the null block (device
  block 0) is in no table, on no free list, and counted in no total.
- A table of ``n`` tokens has ``ceil(n / block_size)`` blocks: only the last is
  partly empty, so waste per sequence is under one block. The exception is a
  *reservation* (``allocate(..., reserve_tokens=r)``, how the Orca and
  FasterTransformer baselines of the paper's experiments hold memory): the table
  then holds at least ``ceil(r / block_size)`` blocks from admission on, the
  ones past its tokens held (counted as used) but empty until it grows into them.
- A sequence only writes into a block with reference count 1: ``append_slot``
  copies a shared partly filled last block first (copy-on-write).
- Only blocks whose K/V are computed are findable by prefix lookup.
- With a sliding window on every layer (``sliding_window``; a layer group's layers in
  ``hybrid_block_manager``), a table's leading entries wholly outside the window of every
  token still to compute are *freed*: they hold no block and no reference (the null block
  on the device, so block indices and the layout attention reads are unchanged; the window
  masks those positions). Freed entries are only leading ones, of blocks whose every token
  is ``sliding_window`` behind the newest: a decoding sequence holds at most
  ``ceil(sliding_window / block_size) + 1`` blocks.
- With ``max_num_batched_tokens`` set (the hybrid manager's windowed groups), a table covers the
  sequence's tokens only up to that many past its computed ones (``tokens_to_hold``): a long prompt
  takes its blocks chunk by chunk, and, as the window frees the blocks behind, never holds more than
  the window's and a chunk's: ``ceil((sliding_window + max_num_batched_tokens + block_size - 1) / block_size)``.

Prefix sharing (automatic prefix caching, pinned prefixes): :mod:`~paged_jax.memory.prefix_sharing`;
swapping: :mod:`~paged_jax.memory.swapping`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Optional

from paged_jax.memory.block_allocator import NULL_BLOCK, BlockAllocator, Device
from paged_jax.memory.block_pool import BlockPool, KVCacheUsage
from paged_jax.memory.block_table import (AllocationPlan, AllocStatus, BlockTable, blocks_for, num_growth_blocks,
                                          plan_allocation, plan_growth, tokens_to_hold)
from paged_jax.memory.prefix_cache import PrefixCache
from paged_jax.memory.prefix_sharing import PrefixSharing
from paged_jax.memory.swapping import Swapping
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["AllocStatus", "BlockManager", "BlockTable", "KVCacheUsage"]


class BlockManager(PrefixSharing, Swapping):
    """Block tables, reference counts, copy-on-write, swap plans and prefix sharing.

    ``num_gpu_blocks`` is the number of physical device blocks (the first
    dimension of the KV cache arrays), the null block included; sequences can
    use ``num_gpu_blocks - 1``. The host pool has ``num_cpu_blocks`` blocks and
    no null block. ``watermark`` (a fraction of the device pool) is kept free at
    admission (``can_allocate``, ``can_swap_in``) to spare running sequences
    from preemption as they grow. ``max_num_batched_tokens``: the most tokens a step computes of
    one sequence (the scheduler's budget); set, a table grows chunk by chunk (module docstring).
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, enable_block_sharing: bool = True,
                 sliding_window: Optional[int] = None, max_num_batched_tokens: Optional[int] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if enable_prefix_caching and not enable_block_sharing:
            raise ValueError("enable_prefix_caching=True needs enable_block_sharing=True")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or a positive integer, got {sliding_window!r}")
        if max_num_batched_tokens is not None and (not isinstance(max_num_batched_tokens, int)
                                                   or max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be None or a positive integer, "
                             f"got {max_num_batched_tokens!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # False: a baseline that copies instead of sharing (fork copies every block; a request's
        # samples or beams never share). For measuring what sharing saves.
        self.enable_block_sharing = enable_block_sharing
        # Set only when every layer (of the model, or of the layer group) attends through this window.
        self.sliding_window = sliding_window
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gpu_allocator = BlockAllocator(Device.GPU, num_gpu_blocks, reserve_null_block=True)
        self.cpu_allocator = BlockAllocator(Device.CPU, num_cpu_blocks)
        # Pinned prefixes are registered in the cache even when automatic caching is off.
        self._cache = PrefixCache()
        self.gpu_pool = BlockPool(self.gpu_allocator, self._cache)
        self._pools = {Device.GPU: self.gpu_pool, Device.CPU: BlockPool(self.cpu_allocator)}
        self.watermark_blocks = int(watermark * self.gpu_allocator.num_total_blocks)
        self._tables: dict[int, BlockTable] = {}
        # The first block's parent in the prefix cache's hash chain: a layer group's own (see
        # ``hybrid_block_manager``), so that groups sharing one cache never find each other's blocks.
        self._hash_root: Optional[bytes] = None

    # ---- admission -------------------------------------------------------------
    def plan_allocation(self, seq_group: SequenceGroup, use_prefix_cache: bool = True,
                        reserve_tokens: int = 0, match_prefix=None) -> AllocationPlan:
        """What ``allocate`` with these arguments would do now (see ``block_table``). ``match_prefix``: a
        lookup in place of this manager's own (the hybrid manager's: a hit in every layer group)."""
        match = (match_prefix or self._match_prefix) if use_prefix_cache else None
        plan = plan_allocation(_waiting_seqs(seq_group), self.block_size, reserve_tokens, self.enable_block_sharing,
                               match, self.gpu_allocator.get_ref_count, self.max_num_batched_tokens)
        if self.max_num_batched_tokens is None or self.sliding_window is None or plan.min_blocks:
            return plan
        # Chunk by chunk a table grows past its first chunk's blocks, up to its window's and a chunk's: whether
        # a prompt can ever fit is decided by that peak, not by what admission takes.
        most = blocks_for(self.sliding_window + self.max_num_batched_tokens + self.block_size - 1, self.block_size)
        peak = sum(min(blocks_for(p.seq.get_len(), self.block_size), most) for p in plan.seqs if p.same_as is None)
        return dataclasses.replace(plan, num_blocks_uncached=max(plan.num_blocks_uncached, peak))

    def can_allocate(self, seq_group: SequenceGroup, reserve_tokens: int = 0,
                     use_prefix_cache: bool = True) -> AllocStatus:
        """Whether ``allocate`` (with the same arguments) fits now with the watermark to spare."""
        return self.admission(self.plan_allocation(seq_group, use_prefix_cache, reserve_tokens))

    def admission(self, plan) -> AllocStatus:
        """Whether an allocation plan fits now with the watermark to spare (or never will)."""
        if plan.num_blocks_uncached > self.gpu_allocator.num_total_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_gpu_blocks() - plan.num_blocks_taken >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup, use_prefix_cache: bool = True, reserve_tokens: int = 0,
                 match_prefix=None) -> None:
        """Give every WAITING sequence of the group blocks covering its ``get_len()`` tokens.
        Sequences holding the same tokens (a new request's samples) share one set of blocks;
        sequences that diverged (samples or beams recomputed after preemption) share the leading
        full blocks they have in common and own the rest. Leading blocks found in the prefix
        cache are reused and ``num_computed_tokens`` is set to the tokens they hold (whole
        blocks, at most ``get_len() - 1``); without a hit it is 0, and siblings sharing a block
        both compute it in the same step (the same tokens give the same K/V). ``use_prefix_cache
        =False`` skips the lookup (a request wanting every prompt token's logprobs computes them
        all). ``reserve_tokens`` reserves blocks for that many tokens up front (module
        docstring); a reserving group has one sequence. ``match_prefix``: see plan_allocation."""
        plan = self.plan_allocation(seq_group, use_prefix_cache, reserve_tokens, match_prefix)
        if reserve_tokens and len(plan.seqs) > 1:
            raise ValueError(f"request {seq_group.request_id!r}: a reservation is per sequence; "
                             f"it has {len(plan.seqs)} waiting sequences")
        for p in plan.seqs:
            if p.seq.seq_id in self._tables:
                raise ValueError(f"sequence {p.seq.seq_id} already has a block table")
        self.gpu_pool.ensure_free(plan.num_blocks_taken, "allocate")
        # Hold every cached hit first: a fresh block taken below may evict an unreferenced cached one.
        held = [b for p in plan.seqs for b in p.cached]
        self.gpu_pool.incref_all(held)
        tables: list[BlockTable] = []
        for p in plan.seqs:
            if p.same_as is not None:  # the same tokens as an earlier sequence: its whole table
                same = tables[p.same_as]
                shared, hashes, num_fresh = same.blocks, same.block_hashes, 0
            else:  # the cached blocks, the sibling's common full blocks past them, then fresh ones
                sibling = tables[p.sibling].blocks[len(p.cached):p.num_common] if p.sibling is not None else []
                shared, hashes = p.cached + sibling, p.cached_hashes
                num_fresh = p.num_blocks - len(shared)
            for block in shared:
                self.gpu_pool.incref(block)
            blocks = shared + [self.gpu_pool.new_block() for _ in range(num_fresh)]
            table = BlockTable(Device.GPU, blocks, p.num_tokens, list(hashes), plan.min_blocks)
            self._tables[p.seq.seq_id] = table
            p.seq.num_computed_tokens = p.num_computed_tokens
            tables.append(table)
        self.gpu_pool.release_all(held)

    # ---- growth ------------------------------------------------------------------
    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether ``append_slot`` can cover every RUNNING sequence of the group
        (new blocks plus copy-on-write copies, counted exactly)."""
        need = self._num_growth_blocks(seq_group.get_seqs(SequenceStatus.RUNNING), Device.GPU)
        return need <= self.get_num_free_gpu_blocks()

    def append_slot(self, seq: Sequence) -> Optional[tuple[int, int]]:
        """Make the table cover ``seq.get_len()`` tokens (with ``max_num_batched_tokens``, those of
        the next chunk: ``_tokens_to_hold``). If the partly filled last
        block that receives new tokens is shared, it is copied first: the sequence
        gets a fresh block, the old one loses a reference, and ``(src, dst)`` is
        returned for the device copy. Otherwise returns None."""
        table = self._table(seq, Device.GPU)
        if seq.get_len() < table.num_tokens:
            raise ValueError(f"sequence {seq.seq_id} has {seq.get_len()} tokens, fewer than the "
                             f"{table.num_tokens} its blocks hold")
        num_tokens = self._tokens_to_hold(seq, table)
        self._free_outside_window(seq, table)
        growth = plan_growth(table, num_tokens, self.block_size, self.gpu_allocator.get_ref_count)
        self.gpu_pool.ensure_free(growth.num_new + growth.copy_last, "append_slot")
        copy = None
        if growth.copy_last:
            last = table.last_index(self.block_size)
            src = table.blocks[last]
            dst = self.gpu_pool.new_block()
            self.gpu_pool.release(src)
            table.blocks[last] = dst
            copy = (src, dst)
        table.blocks.extend(self.gpu_pool.new_block() for _ in range(growth.num_new))
        table.num_tokens = num_tokens
        return copy

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """``append_slot``'s copy as a list (the hybrid manager's has one per layer group at most)."""
        copy = self.append_slot(seq)
        return [] if copy is None else [copy]

    def rollback(self, seq: Sequence, num_tokens: Optional[int] = None) -> None:
        """Shrink the device table to ``num_tokens`` tokens (default ``seq.get_len()``): speculative
        decoding wrote K/V for proposals that were then rejected. Trailing blocks past them are
        released (fresh, unshared blocks from ``append_slot``: freed), and block hashes past the full
        blocks left are dropped, so no block holding a rejected token is ever registered. A table
        already holding no more tokens is left as it is."""
        table = self._table(seq, Device.GPU)
        num_tokens = seq.get_len() if num_tokens is None else num_tokens
        if num_tokens < 1 or num_tokens >= table.num_tokens:
            return
        keep = max(blocks_for(num_tokens, self.block_size), table.min_blocks, table.num_freed)
        for block in reversed(table.blocks[keep:]):
            self.gpu_pool.release(block)
        del table.blocks[keep:]
        del table.block_hashes[num_tokens // self.block_size:]
        table.num_tokens = num_tokens

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> list[tuple[int, int]]:
        """The child shares all of the parent's blocks (each gains a reference).
        Fork after sampling, when the parent's blocks hold only computed tokens:
        copy-on-write protects the blocks that receive new tokens, not pending ones.
        Returns the (src, dst) device copies to run before the next step: none when
        sharing, every block when ``enable_block_sharing`` is False."""
        parent = self._table(parent_seq)
        if parent.min_blocks:
            raise ValueError(f"sequence {parent_seq.seq_id} holds a reservation; reserved blocks are not shared")
        if child_seq.seq_id in self._tables:
            raise ValueError(f"sequence {child_seq.seq_id} already has a block table")
        if self.enable_block_sharing:
            blocks, copies = list(parent.blocks), []
            for block in parent.live_blocks:
                self._pools[parent.device].incref(block)
        else:
            if parent.device is not Device.GPU:
                raise ValueError(f"sequence {parent_seq.seq_id} is swapped out: fork it on the device")
            self.gpu_pool.ensure_free(len(parent.live_blocks),
                                      "fork without block sharing (enable_block_sharing=False is a measurement "
                                      "baseline; give it a KV cache with room for every copy)")
            live = [self.gpu_pool.new_block() for _ in parent.live_blocks]
            copies = list(zip(parent.live_blocks, live))
            blocks = parent.blocks[:parent.num_freed] + live
        self._tables[child_seq.seq_id] = BlockTable(parent.device, blocks, parent.num_tokens,
                                                    list(parent.block_hashes) if self.enable_block_sharing else [],
                                                    num_freed=parent.num_freed)
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's table (a no-op if it has none). Blocks losing their last
        reference are freed, or kept as evictable cache if registered; the tail is
        released first so it is evicted before the prefix."""
        table = self._tables.pop(seq.seq_id, None)
        if table is not None:
            for block in reversed(table.live_blocks):
                self._pools[table.device].release(block)

    # ---- queries -----------------------------------------------------------------------
    def has_seq(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The sequence's blocks in token order (freed leading entries: the null block)."""
        return list(self._table(seq).blocks)

    def get_num_freed_blocks(self, seq: Sequence) -> int:
        """How many leading entries of the table are freed (the sliding window has passed them)."""
        return self._table(seq).num_freed

    def get_num_free_gpu_blocks(self) -> int:
        """Free device blocks, evictable cached blocks included."""
        return self.gpu_pool.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.num_free_blocks

    def num_blocks_needed(self, prompt_len: int, total_len: int) -> int:
        return blocks_for(total_len, self.block_size)  # at most, for one sequence, prompt to total_len tokens

    def get_usage(self) -> KVCacheUsage:
        """Device pool usage (O(blocks in device tables))."""
        fill, reserved = self._fill()
        fill.update((block, self.block_size) for block in self.gpu_pool.pinned_blocks())
        used = self.gpu_allocator.num_used_blocks
        return KVCacheUsage(self.gpu_allocator.num_total_blocks, used, self._cache.num_evictable,
                            sum(fill.values()), used * self.block_size, reserved)

    def _fill(self) -> tuple[dict[int, int], int]:
        """{used device block of a table: tokens it holds}, and the reserved blocks."""
        fill: dict[int, int] = {}
        reserved = 0
        for table in (t for t in self._tables.values() if t.device is Device.GPU):
            for i, block in enumerate(table.live_blocks, table.num_freed):
                tokens = min(self.block_size, max(0, table.num_tokens - i * self.block_size))
                fill[block] = max(fill.get(block, 0), tokens)
            reserved += len(table.blocks) - blocks_for(table.num_tokens, self.block_size)
        return fill, reserved

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        self._check_pools(self._check_tables())

    def _check_tables(self) -> dict[Device, Counter]:
        """Check each table on its own; returns the references the tables hold, per pool."""
        refs = {Device.GPU: Counter(), Device.CPU: Counter()}
        for seq_id, table in self._tables.items():
            _require(len(table.blocks) == max(blocks_for(table.num_tokens, self.block_size), table.min_blocks),
                     f"sequence {seq_id}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
            _require(len(table.block_hashes) <= table.num_tokens // self.block_size,
                     f"sequence {seq_id}: more block hashes than full blocks")
            if table.num_freed:
                _require(self.sliding_window is not None and
                         table.num_freed * self.block_size <= table.num_tokens - self.sliding_window,
                         f"sequence {seq_id}: {table.num_freed} leading blocks freed, but not all of their tokens "
                         f"are {self.sliding_window} behind its {table.num_tokens} tokens")
                _require(table.device is Device.CPU or set(table.blocks[:table.num_freed]) == {NULL_BLOCK},
                         f"sequence {seq_id}: a freed entry of a device table is not the null block")
            refs[table.device].update(table.live_blocks)
        return refs

    def _check_pools(self, refs: dict[Device, Counter]) -> None:
        for device, pool in self._pools.items():
            pool.check_invariants(refs[device])
        registered, pinned = set(self._cache.registered_blocks()), set(self.gpu_pool.pinned_blocks())
        _require(self.enable_prefix_caching or registered <= pinned,
                 "without prefix caching only pinned blocks may be registered")

    # ---- internals ------------------------------------------------------------------------
    def _table(self, seq: Sequence, device: Optional[Device] = None) -> BlockTable:
        table = self._tables.get(seq.seq_id)
        if table is None:
            raise KeyError(f"sequence {seq.seq_id} has no block table")
        if device is not None and table.device is not device:
            raise ValueError(f"sequence {seq.seq_id} has its blocks in the {table.device.value} pool, "
                             f"not the {device.value} pool")
        return table

    def _tokens_to_hold(self, seq: Sequence, table: BlockTable) -> int:
        """The tokens ``append_slot`` makes the table cover (never fewer than it does)."""
        horizon = None if table.min_blocks else self.max_num_batched_tokens
        return max(table.num_tokens, tokens_to_hold(seq.get_len(), seq.num_computed_tokens, horizon))

    def _num_growth_blocks(self, seqs: list[Sequence], device: Device) -> int:
        """Fresh blocks ``append_slot`` needs to grow every sequence's table (``_tokens_to_hold``)."""
        tables = [(t, self._tokens_to_hold(seq, t)) for seq in seqs for t in [self._table(seq, device)]]
        return num_growth_blocks(tables, self.block_size, self._pools[device].allocator.get_ref_count)

    def _outside_window(self, seq: Sequence, table: BlockTable) -> range:
        """The live leading entries no token still to compute can see (the earliest such token sits at
        position ``num_computed_tokens`` and sees keys from ``num_computed_tokens - window + 1`` on)."""
        if self.sliding_window is None or table.min_blocks:
            return range(0)
        first_query = min(seq.num_computed_tokens, table.num_tokens - 1)
        num_outside = max(0, first_query - self.sliding_window + 1) // self.block_size
        return range(table.num_freed, min(num_outside, len(table.blocks) - 1))

    def _free_outside_window(self, seq: Sequence, table: BlockTable) -> None:
        for i in self._outside_window(seq, table):
            self.gpu_pool.release(table.blocks[i])
            table.blocks[i] = NULL_BLOCK
            table.num_freed = i + 1

    def _num_freed_by_window(self, seq: Sequence) -> int:
        """Blocks ``_free_outside_window`` would free now: those of the table alone (a block shared
        with a sibling or a pin only loses a reference)."""
        table = self._table(seq, Device.GPU)
        return sum(self.gpu_allocator.get_ref_count(table.blocks[i]) == 1 for i in self._outside_window(seq, table))


def _waiting_seqs(seq_group: SequenceGroup) -> list[Sequence]:
    seqs = seq_group.get_seqs(SequenceStatus.WAITING)
    if not seqs:
        raise ValueError(f"request {seq_group.request_id!r} has no waiting sequence")
    return seqs


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
