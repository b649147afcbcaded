"""The block manager's swapping: a running sequence's blocks moved to the host pool when it is
preempted by swap, and back when it returns. A block shared by several of the moved sequences
becomes one block holding as many references, so sharing and reference counts survive the round
trip; entries a sliding window freed move nothing."""

from __future__ import annotations

from paged_jax.memory.block_allocator import NULL_BLOCK, Device
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus


class Swapping:
    """The swapping operations of :class:`~paged_jax.memory.block_manager.BlockManager` (a base class
    of it, as ``PrefixSharing``: they use its tables and pools)."""

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
        need = len(self._distinct_blocks(seqs)) + self._num_growth_blocks(seqs, Device.CPU)
        return self.get_num_free_gpu_blocks() - need >= self.watermark_blocks

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the SWAPPED sequences' blocks to the device: returns {cpu block: gpu block}."""
        return self._move(seq_group.get_seqs(SequenceStatus.SWAPPED), Device.CPU, Device.GPU)

    def _distinct_blocks(self, seqs: list[Sequence]) -> set[int]:
        return {b for seq in seqs for b in self._table(seq).live_blocks}

    def _move(self, seqs: list[Sequence], src: Device, dst: Device) -> dict[int, int]:
        """Move the sequences' tables from pool ``src`` to ``dst``. Returns {src block: dst block}."""
        tables = [self._table(seq, src) for seq in seqs]
        self._pools[dst].ensure_free(len(self._distinct_blocks(seqs)), f"swap to {dst.value}")
        mapping: dict[int, int] = {}
        for table in tables:
            for block in table.live_blocks:
                if block in mapping:
                    self._pools[dst].incref(mapping[block])
                else:
                    mapping[block] = self._pools[dst].new_block()
                self._pools[src].release(block)
            table.blocks = [NULL_BLOCK] * table.num_freed + [mapping[b] for b in table.live_blocks]
            table.device = dst
            table.block_hashes.clear()  # new blocks: mark_blocks_computed hashes and registers them anew
        return mapping
