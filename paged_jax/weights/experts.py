"""A mixture's experts as one weight: the same linear layer of every expert, stacked.

``ExpertStack(linear)`` holds a weight object of any class (float :class:`DenseLinear`, quantized
:class:`QuantizedLinear`, ...) whose every array has a leading expert axis ``[E, ...]``. So a
checkpoint's experts load through the same readers as any linear layer (a compressed-tensors W4A16
expert is a QuantizedLinear like a dense layer's), and are stacked after (:func:`stack_experts`).

- ``stack(xs)``: ``xs [E, rows, in] -> [E, rows, out]``, each expert's rows through its own weight
  (the class's own matmul under ``jax.vmap``: one batched matmul for float weights);
- ``stack[e]``: expert ``e``'s weight object alone (a static index reads only its arrays).

Its ``parallel`` role is ``"expert"``: tensor parallelism gives each device whole experts, the
leading axis split (its ``AXES``), and :mod:`paged_jax.parallel.experts` runs each device's own.

:class:`paged_jax.weights.panels.PanelExpertStack` is the same function as a float32 stack, stored
for the native grouped matmul (one device, a CPU; ``to_panels`` makes it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from paged_jax.weights.base import check_role, is_weight, weight_class


@weight_class
class ExpertStack:
    STATIC = ("parallel",)
    AXES = {"linear": ("expert",)}  # the leading axis of every array of the stacked weight
    linear: Any
    parallel: Optional[str] = "expert"

    def __post_init__(self):
        check_role(self.parallel)

    @property
    def num_experts(self) -> int:
        return jax.tree.leaves(self.linear)[0].shape[0]

    def __getitem__(self, e):
        return jax.tree.map(lambda a: a[e], self.linear)

    def __call__(self, xs):
        return jax.vmap(lambda w, x: w(x))(self.linear, xs)


def stack_experts(linears: list) -> ExpertStack:
    """One :class:`ExpertStack` of the experts' weight objects (one class, the same static fields:
    one checkpoint scheme for all of them), their arrays stacked on a new leading axis.

    The arrays may be numpy or JAX arrays, or the sharded loader's abstract tensors, which stand
    for a stack by their own ``stacked(parts)`` (:class:`paged_jax.parallel.checkpoint.HFTensor`)."""
    first = linears[0]
    if not all(is_weight(w) for w in linears) or any(jax.tree.structure(w) != jax.tree.structure(first)
                                                      for w in linears):
        kinds = sorted({_describe(w) for w in linears})
        raise ValueError(f"the experts of one layer must be stored alike (one class and format), got {kinds}")

    def stack(*parts):
        if hasattr(parts[0], "stacked"):
            return parts[0].stacked(parts)
        import numpy as np

        if all(isinstance(p, np.ndarray) for p in parts):
            return np.stack(parts)
        return jax.numpy.stack(parts)

    return ExpertStack(jax.tree.map(stack, *linears))


def _describe(w) -> str:
    """A weight's class, static fields and the arrays it holds, e.g. ``QuantizedLinear(bits=4, ..., values, scale)``."""
    if not is_weight(w):
        return type(w).__name__
    static = [f"{f}={getattr(w, f)!r}" for f in type(w).STATIC if f != "parallel"]
    arrays = [f.name for f in dataclasses.fields(w) if f.name not in type(w).STATIC and getattr(w, f.name) is not None]
    return f"{type(w).__name__}({', '.join(static + arrays)})"
