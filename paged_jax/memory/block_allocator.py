"""Free list and reference counts for one pool of KV cache blocks.

The same class serves the device pool (``Device.GPU``, the KV cache arrays) and
the host pool (``Device.CPU``, the swap space). Every block of a pool is in
exactly one of three states:

- **free**: on the free list, reference count 0; ``allocate`` hands it out.
- **used**: reference count >= 1 (one reference per block table or pin holding it).
- **parked**: reference count 0 but *not* on the free list. The owner of the pool
  (the block manager) parks a block whose K/V it wants to keep after the last
  reference is gone: the prefix cache's evictable blocks. ``incref`` takes a
  parked block back into use; ``free`` returns it to the free list (eviction).

Counting: ``num_free_blocks + num_used_blocks + (parked blocks) == num_total_blocks``.

The device pool reserves physical block 0 (``NULL_BLOCK``): padded batch rows
point at it and padded tokens write into it, so it is never allocated, never
freed and counted nowhere: ``num_total_blocks == num_blocks - 1`` for the device
pool (``num_blocks`` is the number of physical blocks, the first dimension of the
KV cache arrays). The host pool has no null block.
"""

from __future__ import annotations

import enum

NULL_BLOCK = 0


class Device(enum.Enum):
    GPU = "gpu"  # the accelerator's KV cache
    CPU = "cpu"  # the host swap space


class NoFreeBlocksError(RuntimeError):
    """A pool has fewer free blocks than an operation needs."""


class DoubleFreeError(ValueError):
    """A block is freed (or dereferenced) that is already free."""


class BlockAllocator:
    """Hands out block ids of one pool and counts the references to each."""

    def __init__(self, device: Device, num_blocks: int, reserve_null_block: bool = False) -> None:
        first = NULL_BLOCK + 1 if reserve_null_block else 0
        if num_blocks < first:
            raise ValueError(f"the {device.value} pool needs at least {first} block(s), got {num_blocks}")
        self.device = device
        self.num_blocks = num_blocks  # physical blocks, null block included
        self.first_block = first  # lowest block id ever handed out
        self.num_total_blocks = num_blocks - first  # blocks available to sequences
        self._ref_counts = [0] * num_blocks
        self._is_free = [False] * first + [True] * self.num_total_blocks
        self._free = list(range(num_blocks - 1, first - 1, -1))  # a stack: pops the lowest id first
        self._num_used = 0

    # ---- counts -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def get_ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    def is_free(self, block: int) -> bool:
        self._check_id(block)
        return self._is_free[block]

    # ---- state changes ------------------------------------------------------
    def allocate(self) -> int:
        """Take a free block; it leaves with reference count 1."""
        if not self._free:
            raise NoFreeBlocksError(
                f"the {self.device.value} pool has no free block ({self._num_used} of "
                f"{self.num_total_blocks} in use, the rest cached)")
        block = self._free.pop()
        self._is_free[block] = False
        self._ref_counts[block] = 1
        self._num_used += 1
        return block

    def incref(self, block: int) -> int:
        """Add a reference to a used or parked block; returns the new count."""
        self._check_id(block)
        if self._is_free[block]:
            raise ValueError(f"block {block} of the {self.device.value} pool is free: allocate it first")
        if self._ref_counts[block] == 0:
            self._num_used += 1
        self._ref_counts[block] += 1
        return self._ref_counts[block]

    def decref(self, block: int) -> int:
        """Drop one reference; returns the new count. At 0 the block is parked:
        the caller either frees it or keeps it as cached."""
        self._check_id(block)
        if self._ref_counts[block] == 0:
            state = "free" if self._is_free[block] else "unreferenced"
            raise DoubleFreeError(
                f"block {block} of the {self.device.value} pool is already {state}: no reference to drop")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._num_used -= 1
        return self._ref_counts[block]

    def free(self, block: int) -> None:
        """Return an unreferenced (parked) block to the free list."""
        self._check_id(block)
        if self._is_free[block]:
            raise DoubleFreeError(f"block {block} of the {self.device.value} pool is already free")
        if self._ref_counts[block]:
            raise ValueError(f"block {block} of the {self.device.value} pool still has "
                             f"{self._ref_counts[block]} reference(s)")
        self._is_free[block] = True
        self._free.append(block)

    # ---- checks -------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not self.first_block <= block < self.num_blocks:
            what = "the null block" if block == NULL_BLOCK and self.first_block else "out of range"
            raise ValueError(f"block {block} is {what} in the {self.device.value} pool "
                             f"(blocks {self.first_block}..{self.num_blocks - 1})")

    def parked_blocks(self) -> list[int]:
        """Blocks with no reference that are not on the free list (O(num_blocks))."""
        return [b for b in range(self.first_block, self.num_blocks)
                if self._ref_counts[b] == 0 and not self._is_free[b]]

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and the counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.device.value} pool: a block is on the free list twice")
        if NULL_BLOCK in free and self.first_block:
            raise AssertionError(f"{self.device.value} pool: the null block is on the free list")
        for b in range(self.first_block, self.num_blocks):
            if (b in free) != self._is_free[b]:
                raise AssertionError(f"{self.device.value} pool: block {b} free flag disagrees with the free list")
            if self._is_free[b] and self._ref_counts[b]:
                raise AssertionError(f"{self.device.value} pool: free block {b} has references")
        used = sum(1 for b in range(self.first_block, self.num_blocks) if self._ref_counts[b] > 0)
        if used != self._num_used:
            raise AssertionError(f"{self.device.value} pool: {used} blocks referenced, counter says {self._num_used}")
