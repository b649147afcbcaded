"""Weight objects: each owns its storage layout and its matmul.

Model code calls ``linear(x, p)`` and ``embedding.lookup(ids)`` / ``embedding.logits(h)``
whatever the storage is. Each class is a JAX pytree (a registered dataclass): its arrays
are children, its layout facts are static. The family chooses each weight's ``parallel``
role when it builds the params, and :mod:`paged_jax.parallel.rules` reads it:

- ``"column"``: output columns split over the ``tp`` axis (Q, gate/up, fc1, an untied LM head);
- ``"kv"``: like ``"column"``, for the K/V projections (repeated first when ``tp`` exceeds the KV heads);
- ``"row"``: input rows split (attention output, down, fc2), the bias added once after the all-reduce;
- ``"vocab"``: an embedding table split over its vocabulary rows;
- ``None``: replicated.

A storage format is one more class here with its own ``__call__`` (``Int8Linear``: int8 weights
with per-column scales, from :func:`quantize_int8`), and a converter (``quantize_int8``,
:func:`paged_jax.native.pack_params`); model code does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

PARALLEL_ROLES = (None, "column", "kv", "row", "vocab")


def _pytree(cls):
    """A frozen dataclass registered as a pytree: fields named in ``cls.STATIC`` are static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    meta = [f for f in fields if f in cls.STATIC]
    return jax.tree_util.register_dataclass(cls, data_fields=[f for f in fields if f not in meta], meta_fields=meta)


def _check_role(role):
    if role not in PARALLEL_ROLES:
        raise ValueError(f"parallel must be one of {PARALLEL_ROLES}, got {role!r}")


@_pytree
class DenseLinear:
    """``x @ w (+ b)``, ``w`` stored ``[in, out]`` (XLA's matmul)."""

    STATIC = ("parallel",)
    w: Any
    b: Any = None
    parallel: Optional[str] = None

    def __post_init__(self):
        _check_role(self.parallel)

    @property
    def in_features(self) -> int:
        return self.w.shape[0]

    def __call__(self, x):
        y = x @ self.w
        return y if self.b is None else y + self.b


@_pytree
class PanelLinear:
    """The same function as a float32 :class:`DenseLinear`, its weight stored as column panels
    ``[P, in, W]`` for the native CPU matmul (:func:`paged_jax.native.pack_linear` makes it;
    output columns past ``out_features`` are zero padding and are cut off)."""

    STATIC = ("out_features", "parallel")
    panels: Any
    b: Any = None
    out_features: int = 0
    parallel: Optional[str] = None

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    def __call__(self, x):
        from paged_jax import native

        y = native.linear(x, self.panels)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        return y if self.b is None else y + self.b


@_pytree
class Int8Linear:
    """``x @ (q * scale) (+ b)``: int8 values ``q`` ``[in, out]`` with one float32 scale per output
    column (symmetric, per channel). The matmul reads the int8 weight and scales its output, which
    is the same product; XLA converts ``q`` inside the step."""

    STATIC = ("parallel",)
    q: Any
    scale: Any
    b: Any = None
    parallel: Optional[str] = None

    def __post_init__(self):
        _check_role(self.parallel)

    @property
    def in_features(self) -> int:
        return self.q.shape[0]

    def __call__(self, x):
        y = (x @ self.q.astype(x.dtype)) * self.scale.astype(x.dtype)
        return y if self.b is None else y + self.b


def quantize_int8(p: DenseLinear) -> Int8Linear:
    """Per output column, symmetric: ``scale = max |w| / 127``, ``q = round(w / scale)``."""
    w = p.w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=0) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)  # an all-zero column: any scale, its values are 0
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Int8Linear(q, scale, p.b, p.parallel)


QUANTIZATION_METHODS = ("int8",)


def quantize_layers(params: dict, method: str) -> dict:
    """Quantize on load: every linear weight of every layer (``params["layers"]``) with ``method``,
    in place and one weight at a time, so each float weight can go as its quantized copy comes;
    embeddings and the LM head stay as they are (as vLLM's on-load quantization leaves them)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, got {method!r}")
    for lp in params["layers"]:
        for key, value in lp.items():
            if isinstance(value, DenseLinear):
                lp[key] = quantize_int8(value)
    return params


@_pytree
class DenseEmbedding:
    """A token table ``[vocab, hidden]``; ``tied``: it is the LM head too (logits ``h @ table.T``)."""

    STATIC = ("tied", "parallel")
    table: Any
    tied: bool = False
    parallel: Optional[str] = "vocab"

    def __post_init__(self):
        _check_role(self.parallel)

    def lookup(self, ids):
        return self.table[ids]

    def logits(self, h):
        return h @ self.table.T


@_pytree
class PanelEmbedding:
    """A tied embedding stored once, as the LM head's panels ``[P, hidden, W]`` for the native
    matmul (``table.T`` packed, vocabulary padded past ``vocab_size``); lookups read the same
    panels (row v in panel v // W, column v % W), so there is no second copy."""

    STATIC = ("vocab_size", "tied", "parallel")
    panels: Any
    vocab_size: int = 0
    tied: bool = True
    parallel: Optional[str] = None

    def lookup(self, ids):
        # the rows DenseEmbedding.lookup gives: negative ids from the end, then clamped
        ids = jnp.clip(jnp.where(ids < 0, ids + self.vocab_size, ids), 0, self.vocab_size - 1)
        W = self.panels.shape[2]
        return self.panels[ids // W, :, ids % W]

    def logits(self, h):
        from paged_jax import native

        return native.linear(h, self.panels)[..., :self.vocab_size]


LINEAR_TYPES = (DenseLinear, PanelLinear, Int8Linear)
EMBEDDING_TYPES = (DenseEmbedding, PanelEmbedding)
WEIGHT_TYPES = LINEAR_TYPES + EMBEDDING_TYPES


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


__all__ = ["DenseLinear", "PanelLinear", "Int8Linear", "quantize_int8", "quantize_layers", "QUANTIZATION_METHODS",
           "DenseEmbedding", "PanelEmbedding", "LINEAR_TYPES", "EMBEDDING_TYPES",
           "WEIGHT_TYPES", "PARALLEL_ROLES", "is_weight", "linear", "map_weights"]
