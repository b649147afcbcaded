"""The block manager: maps each sequence's tokens to physical KV cache blocks.

Plain Python, no JAX. The scheduler asks it what fits (``can_*``) and tells it
what to do; the operations that move data return plans (copy-on-write pairs,
swap mappings) that the executor carries out with ``cache_ops`` before the step.

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

Prefix sharing comes in two forms. *Automatic prefix caching*
(``enable_prefix_caching=True``): ``mark_blocks_computed`` registers each full
computed block under a chained hash (see ``prefix_cache``); ``allocate`` reuses
the leading blocks it finds; a registered block whose last reference goes
stays cached as *evictable* and counts as free; a fresh block is taken from the
free list first, else the least recently used evictable block is evicted.
*Pinned prefixes* (the paper's Sec. 4.4 shared prefix, any setting):
``pin_prefix`` keeps a computed prefix's blocks referenced and findable until
``unpin_prefix``.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from paged_jax.memory.block_allocator import BlockAllocator, Device, NoFreeBlocksError
from paged_jax.memory.prefix_cache import PrefixCache, iter_block_hashes
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once blocks are freed
    NEVER = "never"  # needs more blocks than the pool, minus the watermark, can ever give


@dataclass(frozen=True)
class KVCacheUsage:
    """A snapshot of the device pool. Utilization = stored tokens / used slots."""

    num_total_gpu_blocks: int  # blocks usable by sequences (the null block excluded)
    num_used_gpu_blocks: int  # referenced by a table or a pin
    num_cached_gpu_blocks: int  # unreferenced, kept for prefix hits, evictable (count as free)
    num_tokens_stored: int  # distinct tokens held in used blocks: a shared block counts once
    num_token_slots_used: int  # num_used_gpu_blocks * block_size
    num_reserved_blocks: int = 0  # used blocks reserved ahead of any token (reservations)

    @property
    def utilization(self) -> float:
        return self.num_tokens_stored / self.num_token_slots_used if self.num_token_slots_used else 1.0


@dataclass
class BlockTable:
    device: Device  # the pool its blocks live in
    blocks: list[int]
    num_tokens: int  # tokens the blocks hold
    block_hashes: list[bytes]  # chained hashes of the leading full, computed blocks
    min_blocks: int = 0  # blocks reserved at admission: the table never holds fewer


class BlockManager:
    """Block tables, reference counts, copy-on-write, swap plans and prefix sharing.

    ``num_gpu_blocks`` is the number of physical device blocks (the first
    dimension of the KV cache arrays), the null block included; sequences can
    use ``num_gpu_blocks - 1``. The host pool has ``num_cpu_blocks`` blocks and
    no null block. ``watermark`` (a fraction of the device pool) is kept free at
    admission (``can_allocate``, ``can_swap_in``) to spare running sequences
    from preemption as they grow.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, enable_block_sharing: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if enable_prefix_caching and not enable_block_sharing:
            raise ValueError("enable_prefix_caching=True needs enable_block_sharing=True")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # False: a baseline that copies instead of sharing (fork copies every block; a request's
        # samples or beams never share). For measuring what sharing saves.
        self.enable_block_sharing = enable_block_sharing
        self.gpu_allocator = BlockAllocator(Device.GPU, num_gpu_blocks, reserve_null_block=True)
        self.cpu_allocator = BlockAllocator(Device.CPU, num_cpu_blocks)
        self._allocators = {Device.GPU: self.gpu_allocator, Device.CPU: self.cpu_allocator}
        self.watermark_blocks = int(watermark * self.gpu_allocator.num_total_blocks)
        self._tables: dict[int, BlockTable] = {}
        self._cache = PrefixCache()  # device blocks only; pinned prefixes live here even when caching is off
        self._pins: dict[int, list[int]] = {}
        self._next_pin_handle = 0

    # ---- admission -------------------------------------------------------------
    def can_allocate(self, seq_group: SequenceGroup, reserve_tokens: int = 0) -> AllocStatus:
        """Whether ``allocate`` (with the same ``reserve_tokens``) fits now with the watermark to spare."""
        seqs = _waiting_seqs(seq_group)
        if (self._num_new_blocks(seqs, use_cache=False, reserve_tokens=reserve_tokens)
                > self.gpu_allocator.num_total_blocks - self.watermark_blocks):
            return AllocStatus.NEVER
        need = self._num_new_blocks(seqs, reserve_tokens=reserve_tokens)
        if self.get_num_free_gpu_blocks() - need >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup, use_prefix_cache: bool = True, reserve_tokens: int = 0) -> None:
        """Give every WAITING sequence of the group blocks covering its ``get_len()``
        tokens. Sequences holding the same tokens (a new request's samples) share one
        set of blocks; sequences that diverged (the samples or beams of a request
        recomputed after preemption) share the leading full blocks they have in
        common and own the rest. Leading blocks found in the prefix cache are reused
        and ``num_computed_tokens`` is set to the tokens they hold (whole blocks, at
        most ``get_len() - 1``); without a hit it is 0, and siblings sharing a block
        both compute it in the same step (the same tokens give the same K/V).
        ``use_prefix_cache=False`` skips the lookup (a request that wants every
        prompt token's logprobs must compute every prompt token). ``reserve_tokens``
        reserves blocks for that many tokens up front (see the module docstring); a
        reserving group has one sequence."""
        seqs = _waiting_seqs(seq_group)
        if reserve_tokens and len(seqs) > 1:
            raise ValueError(f"request {seq_group.request_id!r}: a reservation is per sequence; "
                             f"it has {len(seqs)} waiting sequences")
        for seq in seqs:
            if seq.seq_id in self._tables:
                raise ValueError(f"sequence {seq.seq_id} already has a block table")
        self._ensure_free(Device.GPU, self._num_new_blocks(seqs, use_prefix_cache, reserve_tokens), "allocate")
        min_blocks = self._blocks_for(reserve_tokens)
        done: list[tuple[list[int], BlockTable, int]] = []  # tokens, table, computed tokens
        for seq in seqs:
            tokens = seq.get_token_ids()
            same = next((d for d in done if d[0] == tokens), None) if self.enable_block_sharing else None
            if same is not None:
                blocks, hashes, computed = same[1].blocks, same[1].block_hashes, same[2]
                for block in blocks:
                    self.gpu_allocator.incref(block)
            else:
                hits, hashes = self._match_prefix(tokens) if use_prefix_cache else ([], [])
                num_shared, sibling = max(((self._common_full_blocks(tokens, t), tab) for t, tab, _ in done
                                           if self.enable_block_sharing), key=lambda x: x[0], default=(0, None))
                for block in hits:
                    self._take_cached(block)
                blocks = list(hits)
                for block in sibling.blocks[len(hits):num_shared] if sibling else ():
                    self.gpu_allocator.incref(block)
                    blocks.append(block)
                num_blocks = max(self._blocks_for(len(tokens)), min_blocks)
                blocks += [self._new_block(Device.GPU) for _ in range(num_blocks - len(blocks))]
                computed = len(hits) * self.block_size
            table = BlockTable(Device.GPU, list(blocks), len(tokens), list(hashes), min_blocks)
            self._tables[seq.seq_id] = table
            seq.num_computed_tokens = computed
            done.append((tokens, table, computed))

    # ---- growth ------------------------------------------------------------------
    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether ``append_slot`` can cover every RUNNING sequence of the group
        (new blocks plus copy-on-write copies, counted exactly)."""
        need = self._num_append_blocks(seq_group.get_seqs(SequenceStatus.RUNNING), Device.GPU)
        return need <= self.get_num_free_gpu_blocks()

    def append_slot(self, seq: Sequence) -> Optional[tuple[int, int]]:
        """Make the table cover ``seq.get_len()`` tokens. If the partly filled last
        block that receives new tokens is shared, it is copied first: the sequence
        gets a fresh block, the old one loses a reference, and ``(src, dst)`` is
        returned for the device copy. Otherwise returns None."""
        table = self._table(seq, Device.GPU)
        num_tokens = seq.get_len()
        if num_tokens < table.num_tokens:
            raise ValueError(f"sequence {seq.seq_id} has {num_tokens} tokens, fewer than the "
                             f"{table.num_tokens} its blocks hold")
        copy_last = self._needs_copy(table, num_tokens)
        num_new = max(0, self._blocks_for(num_tokens) - len(table.blocks))
        self._ensure_free(Device.GPU, num_new + copy_last, "append_slot")
        copy = None
        if copy_last:
            last = self._last_index(table)
            src = table.blocks[last]
            dst = self._new_block(Device.GPU)
            self._release(Device.GPU, src)
            table.blocks[last] = dst
            copy = (src, dst)
        table.blocks.extend(self._new_block(Device.GPU) for _ in range(num_new))
        table.num_tokens = num_tokens
        return copy

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
        allocator = self._allocators[parent.device]
        if self.enable_block_sharing:
            blocks, copies = list(parent.blocks), []
            for block in parent.blocks:
                allocator.incref(block)
        else:
            if parent.device is not Device.GPU:
                raise ValueError(f"sequence {parent_seq.seq_id} is swapped out: fork it on the device")
            self._ensure_free(Device.GPU, len(parent.blocks),
                              "fork without block sharing (enable_block_sharing=False is a measurement baseline; "
                              "give it a KV cache with room for every copy)")
            blocks = [self._new_block(Device.GPU) for _ in parent.blocks]
            copies = list(zip(parent.blocks, blocks))
        self._tables[child_seq.seq_id] = BlockTable(parent.device, blocks, parent.num_tokens,
                                                    list(parent.block_hashes) if self.enable_block_sharing else [])
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's table (a no-op if it has none). Blocks losing their last
        reference are freed, or kept as evictable cache if registered; the tail is
        released first so it is evicted before the prefix."""
        table = self._tables.pop(seq.seq_id, None)
        if table is not None:
            for block in reversed(table.blocks):
                self._release(table.device, block)

    # ---- swapping ------------------------------------------------------------------
    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return len(self._distinct_blocks(seqs)) <= self.cpu_allocator.num_free_blocks

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the RUNNING sequences' blocks to the host: returns {gpu block: cpu block}."""
        return self._move(seq_group.get_seqs(SequenceStatus.RUNNING), Device.GPU, Device.CPU)

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        """Whether the SWAPPED sequences' blocks, plus the blocks ``append_slot`` will
        then need to cover ``get_len()``, fit with the watermark to spare."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        need = len(self._distinct_blocks(seqs)) + self._num_append_blocks(seqs, Device.CPU)
        return self.get_num_free_gpu_blocks() - need >= self.watermark_blocks

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the SWAPPED sequences' blocks to the device: returns {cpu block: gpu block}."""
        return self._move(seq_group.get_seqs(SequenceStatus.SWAPPED), Device.CPU, Device.GPU)

    # ---- prefix sharing --------------------------------------------------------------
    def mark_blocks_computed(self, seq: Sequence) -> None:
        """Register the full blocks wholly below ``seq.num_computed_tokens`` in the
        prefix cache. The engine calls it after each step; a no-op without caching."""
        if self.enable_prefix_caching:
            for block_hash, token_ids, block in self._hash_computed_blocks(seq):
                self._cache.register(block_hash, token_ids, block)

    def pin_prefix(self, seq: Sequence) -> int:
        """Pin the full computed blocks of a prefix-only sequence (computed and
        marked): each gains a reference, so it is never freed or evicted, and is
        registered so that ``allocate`` finds it, with or without automatic prefix
        caching. A prefix shorter than a block pins nothing. Returns a handle for
        ``unpin_prefix``."""
        table = self._table(seq, Device.GPU)
        num_full = min(seq.num_computed_tokens, table.num_tokens) // self.block_size
        pinned = []
        for i, (block_hash, block_tokens) in enumerate(
                iter_block_hashes(seq.get_token_ids(), self.block_size, num_full)):
            block = self._cache.lookup(block_hash, block_tokens)
            if block is None:  # register our copy (fails only on a hash collision: then pinned, not findable)
                block = table.blocks[i]
                self._cache.register(block_hash, block_tokens, block)
            self._take_cached(block)
            pinned.append(block)
        handle = self._next_pin_handle
        self._next_pin_handle += 1
        self._pins[handle] = pinned
        return handle

    def unpin_prefix(self, handle: int) -> None:
        """Drop a pin's references. Without automatic prefix caching the blocks also
        stop being findable (unless another pin holds them)."""
        if handle not in self._pins:
            raise ValueError(f"no pinned prefix with handle {handle}")
        blocks = self._pins.pop(handle)
        if not self.enable_prefix_caching:
            still_pinned = {b for pin in self._pins.values() for b in pin}
            for block in blocks:
                if block not in still_pinned and self._cache.is_registered(block):
                    self._cache.deregister(block)
        for block in reversed(blocks):
            self._release(Device.GPU, block)

    def get_pinned_blocks(self, handle: int) -> list[int]:
        return list(self._pins[handle])

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block; returns how many were evicted."""
        n = self._cache.num_evictable
        for _ in range(n):
            self.gpu_allocator.free(self._cache.evict())
        return n

    # ---- queries -----------------------------------------------------------------------
    def has_seq(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        return list(self._table(seq).blocks)

    def get_num_free_gpu_blocks(self) -> int:
        """Free device blocks, evictable cached blocks included."""
        return self.gpu_allocator.num_free_blocks + self._cache.num_evictable

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.num_free_blocks

    def get_usage(self) -> KVCacheUsage:
        """Device pool usage (O(blocks in device tables))."""
        fill: dict[int, int] = {}  # used block -> tokens it holds
        reserved = 0
        for table in self._tables.values():
            if table.device is Device.GPU:
                for i, block in enumerate(table.blocks):
                    tokens = min(self.block_size, max(0, table.num_tokens - i * self.block_size))
                    fill[block] = max(fill.get(block, 0), tokens)
                reserved += len(table.blocks) - self._blocks_for(table.num_tokens)
        for pin in self._pins.values():
            fill.update((block, self.block_size) for block in pin)
        used = self.gpu_allocator.num_used_blocks
        return KVCacheUsage(self.gpu_allocator.num_total_blocks, used, self._cache.num_evictable,
                            sum(fill.values()), used * self.block_size, reserved)

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        refs = {Device.GPU: Counter(), Device.CPU: Counter()}
        for seq_id, table in self._tables.items():
            _require(len(table.blocks) == max(self._blocks_for(table.num_tokens), table.min_blocks),
                     f"sequence {seq_id}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
            _require(len(table.block_hashes) <= table.num_tokens // self.block_size,
                     f"sequence {seq_id}: more block hashes than full blocks")
            refs[table.device].update(table.blocks)
        pinned = {b for pin in self._pins.values() for b in pin}
        for pin in self._pins.values():
            refs[Device.GPU].update(pin)
        for device, allocator in self._allocators.items():
            allocator.check_invariants()
            valid = range(allocator.first_block, allocator.num_blocks)
            _require(all(b in valid for b in refs[device]),
                     f"{device.value} pool: a table holds the null block or an invalid block")
            for block in valid:
                _require(allocator.get_ref_count(block) == refs[device][block],
                         f"{device.value} block {block}: reference count {allocator.get_ref_count(block)}, "
                         f"held {refs[device][block]} times")
        self._cache.check_invariants()
        _require(set(self.gpu_allocator.parked_blocks()) == set(self._cache.evictable_blocks()),
                 "gpu pool: unreferenced blocks off the free list differ from the evictable cache")
        _require(not self.cpu_allocator.parked_blocks(), "cpu pool: an unreferenced block is off the free list")
        registered = set(self._cache.registered_blocks())
        _require(not any(self.gpu_allocator.is_free(b) for b in registered), "a free block is registered")
        _require(self.enable_prefix_caching or registered <= pinned,
                 "without prefix caching only pinned blocks may be registered")

    # ---- internals ------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _table(self, seq: Sequence, device: Optional[Device] = None) -> BlockTable:
        table = self._tables.get(seq.seq_id)
        if table is None:
            raise KeyError(f"sequence {seq.seq_id} has no block table")
        if device is not None and table.device is not device:
            raise ValueError(f"sequence {seq.seq_id} has its blocks in the {table.device.value} pool, "
                             f"not the {device.value} pool")
        return table

    def _ensure_free(self, device: Device, num_blocks: int, what: str) -> None:
        free = self.get_num_free_gpu_blocks() if device is Device.GPU else self.get_num_free_cpu_blocks()
        if num_blocks > free:
            raise NoFreeBlocksError(f"{what} needs {num_blocks} free blocks in the {device.value} pool, "
                                    f"{free} are free")

    def _new_block(self, device: Device) -> int:
        """A block with one reference: from the free list, else the LRU evictable one."""
        allocator = self._allocators[device]
        if device is Device.GPU and not allocator.num_free_blocks and self._cache.num_evictable:
            block = self._cache.evict()
            allocator.incref(block)
            return block
        return allocator.allocate()

    def _take_cached(self, block: int) -> None:
        """Add a reference to a registered device block, reviving it if evictable."""
        if self._cache.is_evictable(block):
            self._cache.unpark(block)
        self.gpu_allocator.incref(block)

    def _release(self, device: Device, block: int) -> None:
        """Drop one reference; at zero a registered device block is cached, others freed."""
        allocator = self._allocators[device]
        if allocator.decref(block) == 0:
            if device is Device.GPU and self._cache.is_registered(block):
                self._cache.park(block)
            else:
                allocator.free(block)

    def _num_blocks_to_take(self, num_blocks: int, hits: list[int]) -> int:
        """Free blocks an allocation of ``num_blocks`` consumes: hits on blocks in use cost nothing."""
        return num_blocks - sum(1 for b in hits if self.gpu_allocator.get_ref_count(b) > 0)

    def _common_full_blocks(self, a: list[int], b: list[int]) -> int:
        """How many leading full blocks hold the same tokens in ``a`` and ``b``."""
        bs, n = self.block_size, 0
        while (n + 1) * bs <= min(len(a), len(b)) and a[n * bs:(n + 1) * bs] == b[n * bs:(n + 1) * bs]:
            n += 1
        return n

    def _num_new_blocks(self, seqs: list[Sequence], use_cache: bool = True, reserve_tokens: int = 0) -> int:
        """Free blocks ``allocate`` takes for these sequences (``use_cache=False``: with nothing cached)."""
        need, seen, revived = 0, [], set()
        for seq in seqs:
            tokens = seq.get_token_ids()
            if self.enable_block_sharing and any(t == tokens for t in seen):
                continue
            num_blocks = max(self._blocks_for(len(tokens)), self._blocks_for(reserve_tokens))
            hits = self._match_prefix(tokens)[0] if use_cache else []
            shared = max((self._common_full_blocks(tokens, t) for t in seen if self.enable_block_sharing), default=0)
            # Fresh blocks past the shared/cached ones, plus cached blocks revived from the evictable
            # pool (they count as free), each once even when several siblings map it.
            need += num_blocks - max(shared, len(hits))
            new_hits = {b for b in hits if self.gpu_allocator.get_ref_count(b) == 0} - revived
            need += len(new_hits)
            revived |= new_hits
            seen.append(tokens)
        return need

    def _match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Leading cached blocks for these tokens and their hashes; the last token is
        never covered, so a hit always leaves at least one token to compute."""
        return self._cache.match(token_ids, self.block_size, max(0, len(token_ids) - 1) // self.block_size)

    def _hash_computed_blocks(self, seq: Sequence) -> list[tuple[bytes, tuple[int, ...], int]]:
        """Extend the table's hashes over its full computed blocks; returns
        (hash, tokens, block) of each newly hashed block."""
        table = self._table(seq, Device.GPU)
        num_full = min(seq.num_computed_tokens, table.num_tokens) // self.block_size
        start = len(table.block_hashes)
        if start >= num_full:
            return []
        parent = table.block_hashes[-1] if start else None
        new = list(iter_block_hashes(seq.get_token_ids(), self.block_size, num_full, start, parent))
        table.block_hashes.extend(h for h, _ in new)
        return [(h, tokens, table.blocks[i]) for i, (h, tokens) in enumerate(new, start)]

    def _needs_copy(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether growing to ``num_tokens`` writes into a shared, partly filled last block."""
        return (num_tokens > table.num_tokens and table.num_tokens % self.block_size != 0
                and self._allocators[table.device].get_ref_count(table.blocks[self._last_index(table)]) > 1)

    def _last_index(self, table: BlockTable) -> int:
        """Index of the block holding the table's last token (the last block unless reserved)."""
        return (table.num_tokens - 1) // self.block_size

    def _num_append_blocks(self, seqs: list[Sequence], device: Device) -> int:
        """Fresh blocks needed to grow every sequence's table to ``get_len()`` tokens.
        Of k sequences writing into one shared last block with reference count r,
        k copy it if r > k, and k - 1 if r == k (the last one writes in place)."""
        need = 0
        writers: Counter[int] = Counter()
        for seq in seqs:
            table = self._table(seq, device)
            need += max(0, self._blocks_for(seq.get_len()) - len(table.blocks))
            if self._needs_copy(table, seq.get_len()):
                writers[table.blocks[self._last_index(table)]] += 1
        allocator = self._allocators[device]
        return need + sum(k - (allocator.get_ref_count(b) == k) for b, k in writers.items())

    def _distinct_blocks(self, seqs: list[Sequence]) -> set[int]:
        return {b for seq in seqs for b in self._table(seq).blocks}

    def _move(self, seqs: list[Sequence], src: Device, dst: Device) -> dict[int, int]:
        """Move the sequences' tables from pool ``src`` to ``dst``. A block shared by
        several of them becomes one block holding as many references: sharing and
        reference counts survive the round trip. Returns {src block: dst block}."""
        tables = [self._table(seq, src) for seq in seqs]
        self._ensure_free(dst, len(self._distinct_blocks(seqs)), f"swap to {dst.value}")
        mapping: dict[int, int] = {}
        for table in tables:
            for block in table.blocks:
                if block in mapping:
                    self._allocators[dst].incref(mapping[block])
                else:
                    mapping[block] = self._new_block(dst)
                self._release(src, block)
            table.blocks = [mapping[b] for b in table.blocks]
            table.device = dst
            table.block_hashes.clear()  # new blocks: mark_blocks_computed hashes and registers them anew
        return mapping


def _waiting_seqs(seq_group: SequenceGroup) -> list[Sequence]:
    seqs = seq_group.get_seqs(SequenceStatus.WAITING)
    if not seqs:
        raise ValueError(f"request {seq_group.request_id!r} has no waiting sequence")
    return seqs


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
