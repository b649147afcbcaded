"""Block-level operations on the KV cache: copy-on-write copies and swapping.

The device KV cache is a list over layers of ``(k, v)`` arrays, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (block 0 is the null
block). The host pool has the same structure as numpy arrays with
``num_cpu_blocks`` blocks. The block manager plans (``append_slot`` returns
copy pairs, ``swap_out`` / ``swap_in`` return mappings); these functions carry
the plans out, each in one jitted call over all layers.

Index lists are padded to a power-of-two bucket (at least ``MIN_BUCKET``), so
the number of compiled shapes grows with the log of the largest batch of
blocks, not with every batch size. Padding entries name the null block: a
padded copy is ``0 -> 0`` and a padded swap-in writes zeros into block 0, whose
contents are never read unmasked. Device caches passed to ``copy_blocks`` and
``swap_in`` are donated: use the returned caches, not the arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.utils import pow2_bucket

from paged_jax.memory.block_allocator import NULL_BLOCK

KVCaches = list[tuple[jax.Array, jax.Array]]
HostPool = list[tuple[np.ndarray, np.ndarray]]
MIN_BUCKET = 8


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype=jnp.float32, sharding=None) -> KVCaches:
    """Zeroed device KV cache, ``num_blocks`` physical blocks (null block included). With a
    ``sharding`` (tensor parallelism: split over KV heads) each device allocates only its shard."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding) if sharding else (
        lambda: jnp.zeros(shape, dtype))
    return [(zeros(), zeros()) for _ in range(num_layers)]


def allocate_host_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype=jnp.float32) -> HostPool:
    """Zeroed host swap space with the device cache's structure and ``num_blocks`` blocks."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(np.zeros(shape, dtype), np.zeros(shape, dtype)) for _ in range(num_layers)]


def bucket_size(n: int) -> int:
    """Smallest power of two >= max(n, MIN_BUCKET)."""
    return pow2_bucket(n, MIN_BUCKET)


def _padded(indices: Sequence[int]) -> np.ndarray:
    out = np.full(bucket_size(len(indices)), NULL_BLOCK, np.int32)
    out[:len(indices)] = indices
    return out


@partial(jax.jit, donate_argnums=0)
def _copy(kv_caches: KVCaches, src: jax.Array, dst: jax.Array) -> KVCaches:
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]


@jax.jit
def _gather(kv_caches: KVCaches, blocks: jax.Array) -> jax.Array:
    """[num_layers, 2, len(blocks), block_size, num_kv_heads, head_dim]."""
    return jnp.stack([jnp.stack([k[blocks], v[blocks]]) for k, v in kv_caches])


@partial(jax.jit, donate_argnums=0)
def _scatter(kv_caches: KVCaches, blocks: jax.Array, data: jax.Array) -> KVCaches:
    return [(k.at[blocks].set(data[i, 0]), v.at[blocks].set(data[i, 1])) for i, (k, v) in enumerate(kv_caches)]


def copy_blocks(kv_caches: KVCaches, src: Sequence[int], dst: Sequence[int]) -> KVCaches:
    """Copy block ``src[i]`` to ``dst[i]`` in every layer (copy-on-write). All reads
    see the cache as it was before the call. Donates ``kv_caches``."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destinations")
    if not src:
        return kv_caches
    return _copy(kv_caches, _padded(src), _padded(dst))


def _pairs(mapping) -> list[tuple[int, int]]:
    """A ``{src: dst}`` dict or a list of ``(src, dst)`` pairs (a source may repeat in a list:
    a device block shared by two groups swapped out in one step goes to two host blocks)."""
    return list(mapping.items()) if isinstance(mapping, Mapping) else list(mapping)


def swap_out(kv_caches: KVCaches, host_pool: HostPool, mapping) -> None:
    """Copy device blocks to host blocks, ``mapping``: ``{gpu block: cpu block}`` or
    ``[(gpu, cpu), ...]`` (``BlockManager.swap_out``): one jitted gather, one transfer."""
    pairs = _pairs(mapping)
    if not pairs:
        return
    data = _gather(kv_caches, _padded([g for g, _ in pairs]))
    if not data.is_fully_addressable:  # split over several hosts: every host keeps the whole block
        from jax.experimental import multihost_utils

        data = multihost_utils.process_allgather(data, tiled=True)
    data = np.asarray(data)
    cpu_blocks = [c for _, c in pairs]
    for i, (k, v) in enumerate(host_pool):
        k[cpu_blocks] = data[i, 0, :len(cpu_blocks)]
        v[cpu_blocks] = data[i, 1, :len(cpu_blocks)]


def swap_in(kv_caches: KVCaches, host_pool: HostPool, mapping) -> KVCaches:
    """Copy host blocks to device blocks, ``mapping``: ``{cpu block: gpu block}`` or
    ``[(cpu, gpu), ...]`` (``BlockManager.swap_in``): one transfer, one jitted scatter. Donates ``kv_caches``."""
    pairs = _pairs(mapping)
    if not pairs:
        return kv_caches
    cpu_blocks = [c for c, _ in pairs]
    k0 = host_pool[0][0]
    data = np.zeros((len(host_pool), 2, bucket_size(len(cpu_blocks))) + k0.shape[1:], k0.dtype)
    for i, (k, v) in enumerate(host_pool):
        data[i, 0, :len(cpu_blocks)] = k[cpu_blocks]
        data[i, 1, :len(cpu_blocks)] = v[cpu_blocks]
    return _scatter(kv_caches, _padded([g for _, g in pairs]), data)


def num_compiled_shapes() -> dict[str, int]:
    """How many shapes each jitted operation has compiled so far in this process."""
    return {"copy_blocks": _copy._cache_size(), "swap_out": _gather._cache_size(),
            "swap_in": _scatter._cache_size()}
