"""A pool of KV blocks by reference count, with the device pool's prefix cache and pins.

The block manager keeps the block tables; a :class:`BlockPool` keeps the blocks
of one device (on top of ``BlockAllocator``): it hands out fresh blocks, adds and
drops references, and decides what happens to a block whose last reference goes.
On the device the pool also holds the prefix cache (``prefix_cache``): a
registered block losing its last reference stays cached as *evictable*, counts
as free, and is evicted (least recently used first) only when the free list is
empty. A *pin* holds references of its own on a prefix's blocks, so they are
never freed or evicted while it lasts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from paged_jax.memory.block_allocator import BlockAllocator, NoFreeBlocksError
from paged_jax.memory.prefix_cache import PrefixCache


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


class BlockPool:
    def __init__(self, allocator: BlockAllocator, cache: Optional[PrefixCache] = None) -> None:
        self.allocator = allocator
        self.device = allocator.device
        self.cache = cache  # the device pool's; None on the host
        self._pins: dict[int, list[int]] = {}
        self._next_pin_handle = 0

    @property
    def num_free(self) -> int:
        """Free blocks, evictable cached blocks included."""
        return self.allocator.num_free_blocks + (self.cache.num_evictable if self.cache else 0)

    def ensure_free(self, num_blocks: int, what: str) -> None:
        if num_blocks > self.num_free:
            raise NoFreeBlocksError(f"{what} needs {num_blocks} free blocks in the {self.device.value} pool, "
                                    f"{self.num_free} are free")

    def new_block(self) -> int:
        """A block with one reference: from the free list, else the LRU evictable one."""
        if self.cache is not None and not self.allocator.num_free_blocks and self.cache.num_evictable:
            block = self.cache.evict()
            self.allocator.incref(block)
            return block
        return self.allocator.allocate()

    def incref(self, block: int) -> None:
        """Add a reference to a block in use, or to an evictable cached one (reviving it)."""
        if self.cache is not None and self.cache.is_evictable(block):
            self.cache.unpark(block)
        self.allocator.incref(block)

    def incref_all(self, blocks: list[int]) -> None:
        for block in blocks:
            self.incref(block)

    def release_all(self, blocks: list[int]) -> None:
        """``release`` each of ``blocks``, the last first."""
        for block in reversed(blocks):
            self.release(block)

    def release(self, block: int) -> None:
        """Drop one reference; at zero a registered block stays cached, others are freed."""
        if self.allocator.decref(block) == 0:
            if self.cache is not None and self.cache.is_registered(block):
                self.cache.park(block)
            else:
                self.allocator.free(block)

    def evict_all(self) -> int:
        """Free every evictable cached block; returns how many."""
        n = self.cache.num_evictable
        for _ in range(n):
            self.allocator.free(self.cache.evict())
        return n

    # ---- pins ------------------------------------------------------------------------
    def pin(self, blocks: list[int]) -> int:
        """Add a reference to each block, held until ``unpin``; returns the pin's handle."""
        for block in blocks:
            self.incref(block)
        handle = self._next_pin_handle
        self._next_pin_handle += 1
        self._pins[handle] = list(blocks)
        return handle

    def unpin(self, handle: int, forget: bool) -> None:
        """Drop a pin's references; ``forget``: blocks no other pin holds are deregistered
        from the cache (no longer findable)."""
        if handle not in self._pins:
            raise ValueError(f"no pinned prefix with handle {handle}")
        blocks = self._pins.pop(handle)
        if forget:
            still_pinned = set(self.pinned_blocks())
            for block in blocks:
                if block not in still_pinned and self.cache.is_registered(block):
                    self.cache.deregister(block)
        for block in reversed(blocks):
            self.release(block)

    def get_pin(self, handle: int) -> list[int]:
        return list(self._pins[handle])

    def pinned_blocks(self) -> list[int]:
        """The blocks of every pin, once per pin holding them."""
        return [block for pin in self._pins.values() for block in pin]

    def check_invariants(self, table_refs: Counter[int]) -> None:
        """Raise AssertionError unless every block's reference count is the number of
        tables (``table_refs``) plus pins holding it, and the cache agrees with the pool."""
        name = self.device.value
        self.allocator.check_invariants()
        refs = table_refs + Counter(self.pinned_blocks())
        valid = range(self.allocator.first_block, self.allocator.num_blocks)
        _require(all(b in valid for b in refs), f"{name} pool: a table holds the null block or an invalid block")
        for block in valid:
            count = self.allocator.get_ref_count(block)
            _require(count == refs[block], f"{name} block {block}: reference count {count}, held {refs[block]} times")
        parked = set(self.allocator.parked_blocks())
        if self.cache is None:
            _require(not parked, f"{name} pool: an unreferenced block is off the free list")
            return
        self.cache.check_invariants()
        _require(parked == set(self.cache.evictable_blocks()),
                 f"{name} pool: unreferenced blocks off the free list differ from the evictable cache")
        _require(not any(self.allocator.is_free(b) for b in self.cache.registered_blocks()),
                 "a free block is registered")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
