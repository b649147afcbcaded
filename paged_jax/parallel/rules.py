"""Megatron-style sharding: each weight object's ``parallel`` role and its class's declared axes
-> PartitionSpec.

The family chooses every weight's role when it builds the params, and each weight class
declares what each dimension of its arrays is (``AXES``, :mod:`paged_jax.weights.base`); the role
names the axis the ``tp`` mesh axis splits (``ROLE_AXIS``: ``"column"`` and ``"kv"`` the output
features, ``"row"`` the input features, ``"vocab"`` an embedding's rows). So a column-parallel
``[in, out]`` weight is ``P(None, "tp")`` and its bias ``P("tp")``; a row-parallel one
``P("tp", None)`` with its bias replicated (added once, after XLA's all-reduce of the partial
sums); ``"expert"`` the leading axis of every array of a stack of experts (whole experts to each
device); no role, and every plain array (norms, learned positions), is replicated. A new weight
class is sharded by its declaration, with nothing to add here.

A dimension that the mesh axis does not divide (e.g. a vocabulary of 517 over 4 devices)
stays replicated: head counts are checked up front (``check_tensor_parallel``), vocabulary
sharding is an optimisation only.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "tp"
REPLICATED = P()

# The KV cache, per layer (k, v) each [num_blocks, block_size, num_kv_heads, head_dim]: split over KV heads.
KV_CACHE_SPEC = P(None, None, AXIS, None)


def fit(spec: P, shape: tuple, tp: int) -> P:
    """``spec`` with the dims ``tp`` does not divide left replicated."""
    if len(spec) not in (0, len(shape)):
        raise ValueError(f"sharding {spec} does not fit an array of shape {shape}")
    return P(*(ax if ax is None or shape[i] % tp == 0 else None for i, ax in enumerate(spec)))


def weight_specs(weight, tp: int, replicate_kv: bool = False):
    """``weight`` (a weight object whose array fields have ``.shape``) with a PartitionSpec in
    each array field: ``tp`` on the dimensions its class declares as the role's axis. ``replicate_kv``:
    ``"kv"`` weights load replicated (their heads are repeated afterwards,
    ``paged_jax.parallel.checkpoint.replicate_kv_heads``)."""
    import jax

    from paged_jax.weights import ROLE_AXIS, is_weight

    role = None if replicate_kv and weight.parallel == "kv" else weight.parallel
    split = ROLE_AXIS.get(role)
    out = {}
    for f in dataclasses.fields(weight):
        x = getattr(weight, f.name)
        axes = type(weight).AXES.get(f.name, ())
        spec = P(*(AXIS if a == split else None for a in axes)) if split in axes else REPLICATED
        if hasattr(x, "shape"):
            out[f.name] = fit(spec, tuple(x.shape), tp)
        elif is_weight(x):  # a weight inside (a stack of experts): the axes name its arrays' leading dims
            out[f.name] = jax.tree.map(lambda a: fit(P(*spec, *[None] * (len(a.shape) - len(spec))), tuple(a.shape),
                                                     tp), x)
    return dataclasses.replace(weight, **out)


def param_shardings(shapes_tree, mesh, replicate_kv: bool = False):
    """A NamedSharding per array of ``shapes_tree`` (params whose arrays are anything with ``.shape``)."""
    import jax

    from paged_jax.weights import is_weight

    tp = mesh.shape[AXIS]

    def shard(x):
        if is_weight(x):
            specs = weight_specs(x, tp, replicate_kv)
            return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                          is_leaf=lambda s: isinstance(s, P))
        return NamedSharding(mesh, REPLICATED)

    return jax.tree_util.tree_map(shard, shapes_tree, is_leaf=is_weight)
