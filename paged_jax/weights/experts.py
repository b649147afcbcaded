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

:class:`PanelExpertStack` is the same function as a float32 stack, stored for the native grouped
matmul (one device, a CPU; :func:`paged_jax.weights.panels.to_panels` makes it): its
``grouped(rows, offsets)`` runs every expert's segment of expert-sorted rows in one call.
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


@weight_class
class PanelExpertStack:
    """A float32 ``ExpertStack(DenseLinear)`` as each expert's weight in column panels,
    ``panels [E, P, in, W]`` (:func:`paged_jax.native.pack_padded` per expert; output columns past
    ``out_features`` are padding, cut off), and its biases ``b [E, out]`` or None."""

    STATIC = ("out_features", "parallel")
    AXES = {}  # one device only
    panels: Any
    b: Any = None
    out_features: int = 0
    parallel: Optional[str] = None

    @classmethod
    def pack(cls, stack: ExpertStack) -> "PanelExpertStack":
        from paged_jax import native

        w = stack.linear.w
        return cls(jax.numpy.stack([native.pack_padded(w[e]) for e in range(w.shape[0])]), stack.linear.b,
                   out_features=w.shape[2])

    @property
    def num_experts(self) -> int:
        return self.panels.shape[0]

    def grouped(self, rows, offsets):
        """``rows [M, in]`` sorted by expert, expert ``e``'s at ``offsets[e]`` .. ``offsets[e + 1]``
        (``offsets [E + 1]``; rows past ``offsets[E]`` give 0) -> ``[M, out]`` float32."""
        from paged_jax.native.grouped import grouped_linear

        jnp = jax.numpy
        y = grouped_linear(rows.astype(jnp.float32), offsets, self.panels)
        y = y if y.shape[-1] == self.out_features else y[:, :self.out_features]
        if self.b is None:
            return y
        E = self.num_experts
        expert = jnp.searchsorted(offsets, jnp.arange(rows.shape[0]), side="right") - 1  # E: past the last
        return y + jnp.where((expert < E)[:, None], self.b[jnp.minimum(expert, E - 1)], 0).astype(jnp.float32)

    def __getitem__(self, e):
        from paged_jax.weights.panels import PanelLinear

        return PanelLinear(self.panels[e], None if self.b is None else self.b[e], out_features=self.out_features)

    def __call__(self, xs):
        E, rows, _ = xs.shape
        y = self.grouped(xs.reshape(E * rows, -1), jax.numpy.arange(E + 1, dtype=jax.numpy.int32) * rows)
        return y.reshape(E, rows, -1)


def packable(stack) -> bool:
    """Whether :meth:`PanelExpertStack.pack` takes ``stack``: float32 dense experts (biases or not)."""
    from paged_jax.weights.dense import DenseLinear

    return isinstance(stack, ExpertStack) and isinstance(stack.linear, DenseLinear) and stack.linear.w.ndim == 3 \
        and stack.linear.w.dtype == jax.numpy.float32


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
