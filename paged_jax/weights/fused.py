"""Linear weights that read the same input, stored side by side as one: a layer's Q, K and V
projections, or its MLP's gate and up ones, each group one native matmul call.

At batch 1 a decode step's matmuls are small (a few hundred kilobytes of weights each) and every
call of a native kernel has a fixed cost beside its work (XLA's thunk, the FFI call, handing part
of the panels to a second thread and waiting for it): ``experiments/profile_decode_step.py``
measures it. :func:`fuse_inputs` (from :func:`paged_jax.weights.prepare`, once the weights are
stored as panels: a CPU, one device) puts the panels of each group (:data:`FUSED_GROUPS`) one
after another in one weight of the same class, a :class:`FusedLinear` under the key
``"q+k+v"`` / ``"gate+up"``, and model code reads such a group through :func:`project`, fused or
not. The kernels sum every output column on its own, over the inputs in order, whichever panel
it sits in, so the fused call gives each part's columns bitwise as the part's own call did; where
a call would run XLA's matmul instead (a quantized weight past
:func:`~paged_jax.native.quantized_native_rows`, another dtype), whose sums depend on the
matrix's shape, the parts are multiplied one by one, as before. Tensor parallelism never meets a
fused weight: panels exist on one device only, and everywhere else Q, K and V stay apart.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import native
from paged_jax.weights.base import weight_class
from paged_jax.weights.panels import PanelInt8Linear, PanelLinear, PanelQuantizedLinear

# Weights of one layer that read the same input (each group's names, in output order).
FUSED_GROUPS = (("q", "k", "v"), ("gate", "up"))


def fused_key(names) -> str:
    return "+".join(names)


def _width(p) -> int:
    """Output columns per panel of a panel weight."""
    return p.scales.shape[-1] if isinstance(p, (PanelQuantizedLinear, PanelInt8Linear)) else p.panels.shape[2]


def _static(p) -> dict:
    return {f: getattr(p, f) for f in type(p).STATIC if f not in ("out_features", "parallel")}


@weight_class
class FusedLinear:
    """Several linear weights of one input as one panel weight (``linear``, of their class) whose
    output columns are the parts' side by side, ``sizes`` columns each; called, it returns the
    parts' outputs, a tuple."""

    STATIC = ("sizes", "parallel")
    AXES = {}  # one device only
    linear: Any
    sizes: tuple = ()
    parallel: Optional[str] = None

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    def __call__(self, x):
        if not _kernel_runs(self.linear, x):
            return tuple(part(x) for part in self.parts())
        y = self.linear(x)
        return tuple(jnp.split(y, np.cumsum(self.sizes)[:-1].tolist(), axis=-1))

    def parts(self) -> list:
        """The weights fused, each as its own weight object again (views of this one's arrays)."""
        W, out = _width(self.linear), []
        first = column = 0
        for size in self.sizes:
            panels = -(-size // W)
            fields = {}
            for f in dataclasses.fields(self.linear):
                a = getattr(self.linear, f.name)
                if f.name in type(self.linear).STATIC or a is None or f.name == "order":
                    continue
                fields[f.name] = a[column:column + size] if f.name == "b" else a[first:first + panels]
            out.append(dataclasses.replace(self.linear, **fields, out_features=size))
            first, column = first + panels, column + size
        return out


def _kernel_runs(p, x) -> bool:
    """Whether ``p``'s call on ``x`` runs a native kernel (whose column sums do not depend on the
    other columns): float32 input on a CPU with the library loaded, and for quantized panels no
    more rows than the build hands to its kernel."""
    if x.dtype != jnp.float32 or jax.default_backend() != "cpu" or not native.loaded():
        return False
    if isinstance(p, PanelQuantizedLinear):
        limit = native.quantized_native_rows(p.kernel)
        return limit is None or math.prod(x.shape[:-1]) <= limit
    return True


def fusable(parts) -> bool:
    """Whether panel weights can be stored as one: one class with the same static fields (format,
    activations), the same inputs and panel width, no activation order, biases on all or none,
    and every part but the last without padding columns (the padding stays at the end)."""
    first = parts[0]
    if type(first) not in (PanelLinear, PanelQuantizedLinear, PanelInt8Linear):
        return False
    W = _width(first)
    for p in parts:
        if type(p) is not type(first) or _static(p) != _static(first) or _width(p) != W:
            return False
        arrays = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in type(p).STATIC}
        ref = {f.name: getattr(first, f.name) for f in dataclasses.fields(first) if f.name not in type(first).STATIC}
        if arrays.get("order") is not None or (arrays["b"] is None) != (ref["b"] is None):
            return False
        if any((a is None) != (ref[n] is None) or a is not None and (a.shape[1:] != ref[n].shape[1:] or a.dtype != ref[n].dtype)
               for n, a in arrays.items() if n != "b"):
            return False
    return all(p.out_features % W == 0 and p.panels.shape[0] * W == p.out_features for p in parts[:-1])


def fuse(parts) -> FusedLinear:
    """One :class:`FusedLinear` of :func:`fusable` panel weights, in their order."""
    first = parts[0]
    fields = {}
    for f in dataclasses.fields(first):
        if f.name in type(first).STATIC or getattr(first, f.name) is None:
            continue
        fields[f.name] = jnp.concatenate([getattr(p, f.name) for p in parts])
    sizes = tuple(p.out_features for p in parts)
    return FusedLinear(dataclasses.replace(first, **fields, out_features=sum(sizes), parallel=None), sizes)


def fuse_inputs(params, groups=FUSED_GROUPS):
    """A copy of ``params`` where, in every dict, each group of :data:`FUSED_GROUPS` whose weights
    are :func:`fusable` panels is one :class:`FusedLinear` under :func:`fused_key` (the parts'
    keys gone; the rest as it was)."""
    if isinstance(params, dict):
        out = {k: fuse_inputs(v, groups) for k, v in params.items()}
        for names in groups:
            parts = [out.get(n) for n in names]
            if all(p is not None for p in parts) and fusable(parts):
                out = {**{k: v for k, v in out.items() if k not in names}, fused_key(names): fuse(parts)}
        return out
    if isinstance(params, (list, tuple)):
        return type(params)(fuse_inputs(v, groups) for v in params)
    return params


def unfused(lp: dict) -> dict:
    """A layer's weights with each fused group's parts under their own names again (views of the
    fused arrays), for code that inspects the weights one by one."""
    out = {}
    for key, value in lp.items():
        if isinstance(value, FusedLinear):
            out.update(zip(key.split("+"), value.parts()))
        else:
            out[key] = value
    return out


def project(x, lp: dict, *names):
    """``tuple(lp[n](x) for n in names)``, in one call where loading fused them (``lp["q+k+v"]``)."""
    fused = lp.get(fused_key(names))
    if fused is not None:
        return fused(x)
    return tuple(lp[n](x) for n in names)
