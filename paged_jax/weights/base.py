"""What every weight object is: a frozen dataclass registered as a JAX pytree, that owns its
storage and its matmul, and declares how tensor parallelism may split it.

Model code calls ``linear(x, p)`` and ``embedding.lookup(ids)`` / ``embedding.logits(h)``
whatever the storage is. A weight class (``@weight_class``) lists

- ``STATIC``: its layout facts, static in the pytree (the other fields are its arrays);
- ``AXES``: for each array field that may be split, what each of its dimensions is: ``"in"``
  (input features), ``"out"`` (output features), ``"vocab"`` (an embedding's rows), ``"expert"``
  (a stack of experts) or None. For a field holding another weight object, the names are those of
  the leading dimensions of each of its arrays. Fields it does not name are replicated.

The family chooses each weight's ``parallel`` role when it builds the params, and the role
says which axis the ``tp`` mesh axis splits (:data:`ROLE_AXIS`, read by
:mod:`paged_jax.parallel.rules`):

- ``"column"``: the output features (Q, gate/up, fc1, an untied LM head);
- ``"kv"``: like ``"column"``, for the K/V projections (repeated first when ``tp`` exceeds the KV heads);
- ``"row"``: the input features (attention output, down, fc2); a bias, whose axis is ``"out"``,
  stays whole and is added once after the all-reduce;
- ``"vocab"``: an embedding table's vocabulary rows;
- ``"expert"``: a mixture's stacked experts, whole experts to each device (expert parallelism,
  :mod:`paged_jax.parallel.experts`);
- ``None``: replicated.
"""

from __future__ import annotations

import dataclasses

import jax

PARALLEL_ROLES = (None, "column", "kv", "row", "vocab", "expert")
ROLE_AXIS = {"column": "out", "kv": "out", "row": "in", "vocab": "vocab", "expert": "expert"}
AXIS_NAMES = (None, "in", "out", "vocab", "expert")

WEIGHT_TYPES: tuple = ()  # every class made with @weight_class, in the order they were defined


def weight_class(cls):
    """``cls`` as a frozen dataclass registered as a pytree (fields in ``cls.STATIC`` static) and as a
    weight class (:func:`is_weight`, :func:`map_weights`, the sharding rules read its ``AXES``)."""
    global WEIGHT_TYPES
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [f for f in (*cls.STATIC, *cls.AXES) if f not in fields]
    bad_axes = {f: a for f, a in cls.AXES.items() if not set(a) <= set(AXIS_NAMES)}
    if unknown or bad_axes or "parallel" not in cls.STATIC:
        raise TypeError(f"{cls.__name__}: STATIC and AXES must name its fields (unknown: {unknown}), AXES use "
                        f"{AXIS_NAMES} (got {bad_axes}), and 'parallel' must be static")
    meta = [f for f in fields if f in cls.STATIC]
    cls = jax.tree_util.register_dataclass(cls, data_fields=[f for f in fields if f not in meta], meta_fields=meta)
    WEIGHT_TYPES = (*WEIGHT_TYPES, cls)
    return cls


def check_role(role) -> None:
    if role not in PARALLEL_ROLES:
        raise ValueError(f"parallel must be one of {PARALLEL_ROLES}, got {role!r}")


def is_weight(x) -> bool:
    return isinstance(x, WEIGHT_TYPES)


def linear(x, p):
    """Apply a linear weight object (any storage format)."""
    return p(x)


def map_weights(fn, params):
    """A copy of ``params`` (nested dicts, lists, tuples) with every weight object ``w`` replaced by
    ``fn(w)``; other leaves are kept, and so is the order of dict keys (``jax.tree_util.tree_map``
    would sort them)."""
    if is_weight(params):
        return fn(params)
    if isinstance(params, dict):
        return {k: map_weights(fn, v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(map_weights(fn, v) for v in params)
    return params
