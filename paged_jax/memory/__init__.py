"""Paged KV memory: block allocation, block tables, copy-on-write, swapping, prefix sharing.

Plain Python; the JAX side (copying and swapping cache blocks) is ``paged_jax.memory.cache_ops``,
imported on its own so that the scheduler never imports JAX.
"""

from paged_jax.memory.block_allocator import NULL_BLOCK, BlockAllocator, Device, DoubleFreeError, NoFreeBlocksError
from paged_jax.memory.block_manager import AllocStatus, BlockManager, BlockTable, KVCacheUsage
from paged_jax.memory.hybrid_block_manager import GroupBlockTables, HybridBlockManager, make_block_manager
from paged_jax.memory.layer_groups import KVLayout, kv_layout
from paged_jax.memory.prefix_cache import PrefixCache, hash_block_tokens

__all__ = [
    "NULL_BLOCK", "AllocStatus", "BlockAllocator", "BlockManager", "BlockTable", "Device", "DoubleFreeError",
    "GroupBlockTables", "HybridBlockManager", "KVCacheUsage", "KVLayout", "NoFreeBlocksError", "PrefixCache",
    "hash_block_tokens", "kv_layout", "make_block_manager",
]
