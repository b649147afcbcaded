"""How many KV blocks a pool gets: the bytes the KV cache may take on this device (or host), and the
blocks of a given layout those bytes hold."""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np

from paged_jax.models.config import ModelConfig


def available_kv_memory(fraction: float, cpu_kv_cache_space: float, num_devices: int = 1,
                        weights_to_load: int = 0) -> int:
    """Bytes the KV cache may take: ``fraction`` of free device memory on an accelerator (summed
    over ``num_devices``, the tensor-parallel shards, each counted as the fullest one), less
    ``weights_to_load`` bytes a device of weights not loaded yet (a draft model's);
    on the CPU at most ``cpu_kv_cache_space`` GiB and half of the available RAM. Across
    several processes, the smallest answer of any (every host must size the same pool)."""
    if jax.devices()[0].platform != "cpu":
        free = []
        for d in jax.local_devices()[:num_devices]:
            stats = d.memory_stats() or {}
            free.append(stats.get("bytes_limit", 0) * fraction - stats.get("bytes_in_use", 0) - weights_to_load)
        nbytes = min(free) * num_devices
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 8 << 30
        nbytes = min(cpu_kv_cache_space * (1 << 30), 0.5 * avail)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        nbytes = float(np.min(multihost_utils.process_allgather(np.float64(nbytes))))
    return int(max(0, nbytes))


def num_blocks_for_memory(config: ModelConfig, block_size: int, nbytes: int,
                          layers_per_block: Optional[int] = None, extra_bytes_per_token: int = 0) -> int:
    """Blocks of ``block_size`` tokens of ``layers_per_block`` layers (default: all) in ``nbytes``, each
    also costing ``extra_bytes_per_token`` a token in a cache indexed by the same block ids (a draft model's)."""
    layers = config.num_layers if layers_per_block is None else layers_per_block
    per_block = block_size * (config.kv_bytes_per_token * layers + extra_bytes_per_token * config.num_layers)
    return nbytes * config.num_layers // per_block
