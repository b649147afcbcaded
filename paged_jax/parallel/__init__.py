"""Tensor parallelism on JAX's SPMD runtime (Megatron-style, over one mesh axis ``"tp"``).

The mesh is ``jax.sharding.Mesh`` over ``tensor_parallel_size`` devices (across hosts
after ``jax.distributed.initialize``). Parameters carry ``NamedSharding``s from the
per-family rule table (:mod:`paged_jax.parallel.rules`); the jitted step is partitioned
by XLA's SPMD partitioner, which inserts the all-reduces after row-parallel layers. The
KV cache is split over KV heads and shares one block table across shards, so the block
manager does not know about devices. The attention backend runs per device inside
``jax.shard_map`` over heads (it needs no communication).

Head counts: ``num_heads`` must be divisible by ``tp``. If ``num_kv_heads`` is not but
``tp`` is a multiple of it (multi-query / few KV heads), each KV head is *replicated*
``tp // num_kv_heads`` times (as vLLM does), so every device holds the one KV head its
query heads use; the KV cache then holds ``tp`` heads. Anything else is refused.

Mixtures of experts: ``tp`` splits the experts, whole experts to each device (expert parallelism,
:mod:`paged_jax.models.moe_experts`), so it must divide their number.
"""

from __future__ import annotations

import dataclasses
from paged_jax.models.config import ModelConfig
from paged_jax.parallel.rules import AXIS, KV_CACHE_SPEC


def check_tensor_parallel(config: ModelConfig, tp: int) -> tuple[ModelConfig, int]:
    """Validate ``tp`` against the model's heads, before any weight is read.

    Returns the config the engine runs (``num_kv_heads`` raised to ``tp`` when KV heads
    are replicated) and the replication factor (1 when none).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if config.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {config.num_heads} attention heads; "
                         f"use a divisor of {config.num_heads}")
    if config.moe is not None and config.moe.num_experts % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {config.moe.num_experts} experts "
                         f"(each device holds whole experts); use a divisor of {config.moe.num_experts}")
    if config.num_kv_heads % tp == 0:
        return config, 1
    if tp % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and the model's {config.num_kv_heads} KV heads do not fit: "
                         f"tp must divide the KV heads or be a multiple of them (then KV heads are replicated)")
    rep = tp // config.num_kv_heads
    return dataclasses.replace(config, num_kv_heads=tp), rep


def make_mesh(tp: int):
    """A 1-D mesh ``("tp",)`` over the first ``tp`` devices (global devices on several hosts)."""
    import jax
    from jax.sharding import AxisType

    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} but only {len(devices)} {devices[0].platform} device(s) "
                         "are visible (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
    return jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices[:tp])


def kv_cache_sharding(mesh):
    from jax.sharding import NamedSharding

    return NamedSharding(mesh, KV_CACHE_SPEC)


def replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())


class ShardedBackend:
    """An attention backend run per device on its own heads (q and the K/V caches split over
    heads, the metadata replicated): its ragged step (or its decode-and-tiles split,
    :func:`~paged_jax.attention.as_ragged`) inside ``jax.shard_map``."""

    def __init__(self, backend, mesh):
        from paged_jax.attention import as_ragged

        self.backend, self.mesh, self.name = as_ragged(backend), mesh, backend.name

    def check(self, spec, dtype) -> None:
        self.backend.check(spec, dtype)

    def _per_device(self, method, q, k_cache, v_cache, meta, spec, sinks=None):
        import jax
        from jax.sharding import PartitionSpec as P

        def local(q, k_cache, v_cache, meta, *sinks):  # sinks: each device's heads' sink logits, if any
            return method(q, k_cache, v_cache, meta, spec, **({"sinks": sinks[0]} if sinks else {}))

        heads = P(*[None] * (q.ndim - 2), AXIS, None)  # [..., H, D] split over H
        extra = () if sinks is None else (sinks,)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(heads, KV_CACHE_SPEC, KV_CACHE_SPEC,
                                                              jax.tree.map(lambda _: P(), meta),
                                                              *[P(AXIS)] * len(extra)),
                             out_specs=heads, check_vma=False)(q, k_cache, v_cache, meta, *extra)

    def ragged(self, q, k_cache, v_cache, meta, spec, sinks=None):
        return self._per_device(self.backend.ragged, q, k_cache, v_cache, meta, spec, sinks)


def shard_backend(backend, mesh) -> ShardedBackend:
    """Run an attention backend per device on its own heads (see :class:`ShardedBackend`)."""
    return ShardedBackend(backend, mesh)


__all__ = ["check_tensor_parallel", "make_mesh", "kv_cache_sharding", "replicated", "shard_backend", "ShardedBackend",
           "AXIS"]
