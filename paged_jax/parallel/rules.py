"""Megatron-style sharding rules: one table per model family, param path -> PartitionSpec.

A param path is the ``/``-joined key path of a leaf in the params pytree
(``layers/3/q/w``). Linear weights are stored ``[in, out]``, so

- column-parallel layers (Q/K/V, up/gate, fc1) split their output columns: ``P(None, "tp")``,
  their bias ``P("tp")``; each device computes its own heads / MLP columns;
- row-parallel layers (attention output, down, fc2) split their input rows: ``P("tp", None)``,
  their bias is replicated (added once, after XLA's all-reduce of the partial sums);
- the token embedding ``[vocab, hidden]`` is split over the vocabulary and the LM head
  ``[hidden, vocab]`` over its columns (vocab-parallel logits, gathered for sampling);
- everything else (norms, learned positions, OPT's project_in/out) is replicated.

A dimension that the mesh axis does not divide (e.g. a vocabulary of 517 over 4 devices)
stays replicated: head counts are checked up front (``check_tensor_parallel``), vocabulary
sharding is an optimisation only. GPT-2's fused ``c_attn`` (Q|K|V concatenated) is kept
replicated: splitting its columns would hand each device a slice of Q only.
"""

from __future__ import annotations

import re

from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "tp"
COL, COL_BIAS, ROW = P(None, AXIS), P(AXIS), P(AXIS, None)
REPLICATED = P()

RULES: dict[str, list[tuple[str, P]]] = {
    "llama": [
        (r"embed", ROW),
        (r"lm_head", COL),
        (r"layers/\d+/(q|k|v|gate|up)/w", COL),
        (r"layers/\d+/(q|k|v|gate|up)/b", COL_BIAS),
        (r"layers/\d+/(o|down)/w", ROW),
    ],
    "opt": [
        (r"embed", ROW),
        (r"lm_head", COL),
        (r"layers/\d+/(q|k|v|fc1)/w", COL),
        (r"layers/\d+/(q|k|v|fc1)/b", COL_BIAS),
        (r"layers/\d+/(o|fc2)/w", ROW),
    ],
    "gpt2": [
        (r"embed", ROW),
        (r"lm_head", COL),
        (r"layers/\d+/fc/w", COL),
        (r"layers/\d+/fc/b", COL_BIAS),
        (r"layers/\d+/(o|proj)/w", ROW),
    ],
}

# The KV cache, per layer (k, v) each [num_blocks, block_size, num_kv_heads, head_dim]: split over KV heads.
KV_CACHE_SPEC = P(None, None, AXIS, None)
# Attention inputs/outputs inside the backend: q [S, Q, heads, D], caches as above.
HEADS_SPEC = P(None, None, AXIS, None)


def path_str(key_path) -> str:
    parts = []
    for k in key_path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def spec_for(family: str, path: str, shape: tuple, tp: int, replicated: tuple[str, ...] = ()) -> P:
    """The PartitionSpec of one parameter; dims the mesh does not divide stay replicated."""
    if family not in RULES:
        raise ValueError(f"no sharding rules for model family {family!r}; known: {sorted(RULES)}")
    if any(re.fullmatch(r, path) for r in replicated):
        return REPLICATED
    for pattern, spec in RULES[family]:
        if re.fullmatch(pattern, path):
            if len(spec) != len(shape):
                raise ValueError(f"sharding rule {pattern!r} -> {spec} does not fit {path} of shape {shape}")
            dims = tuple(ax if ax is None or shape[i] % tp == 0 else None for i, ax in enumerate(spec))
            return P(*dims)
    return REPLICATED


def param_shardings(family: str, shapes_tree, mesh, replicated: tuple[str, ...] = ()):
    """A NamedSharding per leaf of ``shapes_tree`` (any pytree of objects with ``.shape``)."""
    import jax

    tp = mesh.shape[AXIS]
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, spec_for(family, path_str(kp), tuple(x.shape), tp, replicated)),
        shapes_tree)
