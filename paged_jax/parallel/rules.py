"""Megatron-style sharding: each weight object's ``parallel`` role -> PartitionSpec.

The family chooses every weight's role when it builds the params
(``paged_jax.models.weights``); this module only maps roles to specs. Linear weights are
stored ``[in, out]``, so

- ``"column"`` (Q, up/gate, fc1, the LM head) and ``"kv"`` (K, V) split their output
  columns: ``P(None, "tp")``, their bias ``P("tp")``; each device computes its own heads /
  MLP columns / vocabulary slice of the logits;
- ``"row"`` (attention output, down, fc2) split their input rows: ``P("tp", None)``, their
  bias is replicated (added once, after XLA's all-reduce of the partial sums);
- ``"vocab"``: the token embedding ``[vocab, hidden]`` split over the vocabulary;
- no role, and every plain array (norms, learned positions), is replicated.

A dimension that the mesh axis does not divide (e.g. a vocabulary of 517 over 4 devices)
stays replicated: head counts are checked up front (``check_tensor_parallel``), vocabulary
sharding is an optimisation only.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "tp"
COL, COL_BIAS, ROW = P(None, AXIS), P(AXIS), P(AXIS, None)
REPLICATED = P()

# role -> {field: spec}; fields not named are replicated
ROLE_SPECS = {
    # QuantizedLinear: values like w; scale / zero ([G_in, G_out]) split where the mesh divides their
    # groups (any placement gives the same numbers: the step is written for the global arrays)
    "column": {"w": COL, "b": COL_BIAS, "values": COL, "scale": COL, "zero": COL},
    "kv": {"w": COL, "b": COL_BIAS, "values": COL, "scale": COL, "zero": COL},
    "row": {"w": ROW, "values": ROW, "scale": ROW, "zero": ROW},
    "vocab": {"table": ROW},
}

# The KV cache, per layer (k, v) each [num_blocks, block_size, num_kv_heads, head_dim]: split over KV heads.
KV_CACHE_SPEC = P(None, None, AXIS, None)


def fit(spec: P, shape: tuple, tp: int) -> P:
    """``spec`` with the dims ``tp`` does not divide left replicated."""
    if len(spec) not in (0, len(shape)):
        raise ValueError(f"sharding {spec} does not fit an array of shape {shape}")
    return P(*(ax if ax is None or shape[i] % tp == 0 else None for i, ax in enumerate(spec)))


def weight_specs(weight, tp: int, replicate_kv: bool = False):
    """``weight`` (a weight object whose array fields have ``.shape``) with a PartitionSpec in
    each array field. ``replicate_kv``: ``"kv"`` weights load replicated (their heads are
    repeated afterwards, ``paged_jax.parallel.checkpoint.replicate_kv_heads``)."""
    role = None if replicate_kv and weight.parallel == "kv" else weight.parallel
    specs = ROLE_SPECS.get(role, {})
    out = {}
    for f in dataclasses.fields(weight):
        x = getattr(weight, f.name)
        if hasattr(x, "shape"):
            out[f.name] = fit(specs.get(f.name, REPLICATED), tuple(x.shape), tp)
    return dataclasses.replace(weight, **out)


def param_shardings(shapes_tree, mesh, replicate_kv: bool = False):
    """A NamedSharding per array of ``shapes_tree`` (params whose arrays are anything with ``.shape``)."""
    import jax

    from paged_jax.models.weights import is_weight

    tp = mesh.shape[AXIS]

    def shard(x):
        if is_weight(x):
            specs = weight_specs(x, tp, replicate_kv)
            return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                          is_leaf=lambda s: isinstance(s, P))
        return NamedSharding(mesh, REPLICATED)

    return jax.tree_util.tree_map(shard, shapes_tree, is_leaf=is_weight)
