"""The block manager's prefix sharing, in two forms. *Automatic prefix caching*
(``enable_prefix_caching=True``): ``mark_blocks_computed`` registers each full
computed block under a chained hash (see ``prefix_cache``); ``allocate`` reuses
the leading blocks it finds; a registered block whose last reference goes
stays cached as *evictable* and counts as free until evicted (``block_pool``).
*Pinned prefixes* (the paper's Sec. 4.4 shared prefix, any setting):
``pin_prefix`` keeps a computed prefix's blocks referenced and findable until
``unpin_prefix``.
"""

from __future__ import annotations

from paged_jax.memory.block_allocator import Device
from paged_jax.memory.prefix_cache import iter_block_hashes
from paged_jax.sequence import Sequence


class PrefixSharing:
    """The prefix-sharing operations of :class:`~paged_jax.memory.block_manager.BlockManager` (a
    base class of it: they use its tables, its prefix cache and its device pool)."""

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
        if table.num_freed:
            raise ValueError(f"sequence {seq.seq_id}: its leading blocks are freed (past the sliding window); "
                             "a prefix to pin must be shorter than the window")
        num_full = min(seq.num_computed_tokens, table.num_tokens) // self.block_size
        blocks = []
        for i, (block_hash, block_tokens) in enumerate(
                iter_block_hashes(seq.get_token_ids(), self.block_size, num_full, parent_hash=self._hash_root)):
            block = self._cache.lookup(block_hash, block_tokens)
            if block is None:  # register our copy (fails only on a hash collision: then pinned, not findable)
                block = table.blocks[i]
                self._cache.register(block_hash, block_tokens, block)
            blocks.append(block)
        return self.gpu_pool.pin(blocks)

    def unpin_prefix(self, handle: int) -> None:
        """Drop a pin's references. Without automatic prefix caching the blocks also
        stop being findable (unless another pin holds them)."""
        self.gpu_pool.unpin(handle, forget=not self.enable_prefix_caching)

    def get_pinned_blocks(self, handle: int) -> list[int]:
        return self.gpu_pool.get_pin(handle)

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block; returns how many were evicted."""
        return self.gpu_pool.evict_all()

    # ---- internals ------------------------------------------------------------------------
    def _match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Leading cached blocks for these tokens and their hashes; the last token is
        never covered, so a hit always leaves at least one token to compute."""
        return self._cache.match(token_ids, self.block_size, max(0, len(token_ids) - 1) // self.block_size,
                                 self._hash_root)

    def _hash_computed_blocks(self, seq: Sequence) -> list[tuple[bytes, tuple[int, ...], int]]:
        """Extend the table's hashes over its full computed blocks; returns
        (hash, tokens, block) of each newly hashed block."""
        table = self._table(seq, Device.GPU)
        num_full = min(seq.num_computed_tokens, table.num_tokens) // self.block_size
        start = len(table.block_hashes)
        if start >= num_full:
            return []
        parent = table.block_hashes[-1] if start else self._hash_root
        new = list(iter_block_hashes(seq.get_token_ids(), self.block_size, num_full, start, parent))
        table.block_hashes.extend(h for h, _ in new)
        # Freed entries hold no block (their hashes still chain the ones after them).
        return [(h, tokens, table.blocks[i]) for i, (h, tokens) in enumerate(new, start) if i >= table.num_freed]
