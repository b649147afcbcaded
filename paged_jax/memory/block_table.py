"""Block tables, and the plans of what an operation on them takes, counted once.

A plan reads the tables and the pools and changes nothing. The block manager
answers ``can_allocate`` / ``can_append_slots`` / ``can_swap_in`` from a plan and
carries out ``allocate`` / ``append_slot`` from the same plan, so the blocks a
check counts are, by construction, the blocks the operation then takes (two
separate computations of the same numbers could drift apart). A plan is valid
until the next operation on the block manager.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from paged_jax.memory.block_allocator import Device
from paged_jax.sequence import Sequence

RefCount = Callable[[int], int]  # a pool's block -> reference count
PrefixMatch = Callable[[list[int]], tuple[list[int], list[bytes]]]  # tokens -> leading cached blocks, hashes


@dataclass
class BlockTable:
    device: Device  # the pool its blocks live in
    blocks: list[int]
    num_tokens: int  # tokens the blocks hold
    block_hashes: list[bytes]  # chained hashes of the leading full, computed blocks
    min_blocks: int = 0  # blocks reserved at admission: the table never holds fewer
    # Leading entries freed because every layer's sliding window has passed them: they hold no
    # block (the null block on the device, so the layout attention reads keeps its indices).
    num_freed: int = 0

    @property
    def live_blocks(self) -> list[int]:
        """The blocks the table holds (a reference each): all but the freed leading entries."""
        return self.blocks[self.num_freed:]

    def last_index(self, block_size: int) -> int:
        """Index of the block holding the last token (the last block unless reserved)."""
        return (self.num_tokens - 1) // block_size


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def common_full_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """How many leading full blocks hold the same tokens in ``a`` and ``b``."""
    bs, n = block_size, 0
    while (n + 1) * bs <= min(len(a), len(b)) and a[n * bs:(n + 1) * bs] == b[n * bs:(n + 1) * bs]:
        n += 1
    return n


# ---- admission -------------------------------------------------------------------------
class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once blocks are freed
    NEVER = "never"  # needs more blocks than the pool, minus the watermark, can ever give


@dataclass(frozen=True)
class SeqAllocation:
    """How one waiting sequence gets its table."""

    seq: Sequence
    same_as: Optional[int]  # an earlier sequence of the plan with the same tokens: share its whole table
    cached: list[int]  # leading blocks found in the prefix cache (their K/V are computed)
    cached_hashes: list[bytes]
    sibling: Optional[int]  # the earlier sequence with the most leading full blocks in common
    num_common: int  # how many: blocks cached..num_common - 1 are the sibling's
    num_blocks: int  # blocks of the table: the rest are fresh
    num_computed_tokens: int  # tokens whose K/V the table holds already (the cached blocks')
    num_tokens: int  # tokens the table covers: all the sequence's, or its first chunk's (``horizon``)


@dataclass(frozen=True)
class AllocationPlan:
    seqs: list[SeqAllocation]
    min_blocks: int  # blocks reserved per table
    num_blocks_taken: int  # free blocks it consumes (fresh ones, and cached ones revived from eviction)
    num_blocks_uncached: int  # what it would consume with nothing cached: if over the pool, it never fits


def plan_allocation(seqs: list[Sequence], block_size: int, reserve_tokens: int, share: bool,
                    match_prefix: Optional[PrefixMatch], ref_count: RefCount,
                    horizon: Optional[int] = None) -> AllocationPlan:
    """Plan ``BlockManager.allocate`` of ``seqs``: identical sequences share a table;
    diverged ones share the leading full blocks they have in common (``share``);
    leading blocks found by ``match_prefix`` (None: no lookup) are reused. ``horizon``: a
    table covers at most that many tokens past the cached ones (a prompt's first chunk; see
    ``tokens_to_hold``), not the whole sequence; a reservation ignores it."""
    min_blocks = blocks_for(reserve_tokens, block_size)
    plans: list[SeqAllocation] = []
    tokens_of: list[list[int]] = []
    taken = uncached = 0
    revived: set[int] = set()
    for seq in seqs:
        tokens = seq.get_token_ids()
        same = next((i for i, t in enumerate(tokens_of) if t == tokens), None) if share else None
        if same is not None:
            plans.append(SeqAllocation(seq, same, [], [], None, 0, 0, plans[same].num_computed_tokens,
                                       plans[same].num_tokens))
            tokens_of.append(tokens)
            continue
        cached, hashes = match_prefix(tokens) if match_prefix is not None else ([], [])
        num_tokens = tokens_to_hold(len(tokens), len(cached) * block_size, None if min_blocks else horizon)
        num_blocks = max(blocks_for(num_tokens, block_size), min_blocks)
        # A sibling's table may cover fewer tokens than it has (a horizon): share only its full blocks.
        sibling, num_common = max(((i, min(common_full_blocks(tokens, t, block_size),
                                           plans[i].num_tokens // block_size, num_blocks))
                                   for i, t in enumerate(tokens_of) if share), key=lambda x: x[1], default=(None, 0))
        # Fresh blocks past the common and cached ones, plus cached blocks revived from the
        # evictable pool (they count as free), each once even when several siblings map it.
        new_revived = {b for b in cached if ref_count(b) == 0} - revived
        revived |= new_revived
        taken += num_blocks - max(num_common, len(cached)) + len(new_revived)
        uncached += num_blocks - num_common
        plans.append(SeqAllocation(seq, None, cached, hashes, sibling, num_common, num_blocks,
                                   len(cached) * block_size, num_tokens))
        tokens_of.append(tokens)
    return AllocationPlan(plans, min_blocks, taken, uncached)


def tokens_to_hold(num_tokens: int, num_computed: int, horizon: Optional[int]) -> int:
    """The tokens a table of a sequence of ``num_tokens`` tokens, ``num_computed`` of them computed,
    covers: all of them, or with a ``horizon`` (the most tokens a step computes of one sequence) those
    up to ``horizon`` past the computed ones: a windowed layer group takes a prompt's blocks chunk by
    chunk, as the window frees those behind it."""
    return num_tokens if horizon is None else min(num_tokens, num_computed + horizon)


# ---- growth ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Growth:
    """What growing one table to ``num_tokens`` takes."""

    num_new: int  # blocks appended
    copy_last: bool  # the shared, partly filled last block is copied first (copy-on-write)


def plan_growth(table: BlockTable, num_tokens: int, block_size: int, ref_count: RefCount) -> Growth:
    copy_last = (num_tokens > table.num_tokens and table.num_tokens % block_size != 0
                 and ref_count(table.blocks[table.last_index(block_size)]) > 1)
    return Growth(max(0, blocks_for(num_tokens, block_size) - len(table.blocks)), copy_last)


def num_growth_blocks(tables: list[tuple[BlockTable, int]], block_size: int, ref_count: RefCount) -> int:
    """Fresh blocks needed to grow every (table, to num_tokens) in one go. Of k tables
    writing into one shared last block with reference count r, k copy it if r > k,
    and k - 1 if r == k (the last one writes in place)."""
    need = 0
    writers: Counter[int] = Counter()
    for table, num_tokens in tables:
        growth = plan_growth(table, num_tokens, block_size, ref_count)
        need += growth.num_new
        if growth.copy_last:
            writers[table.blocks[table.last_index(block_size)]] += 1
    return need + sum(k - (ref_count(b) == k) for b, k in writers.items())
