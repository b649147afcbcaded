"""Float weights as the checkpoint gives them: XLA's matmul and gather."""

from __future__ import annotations

from typing import Any, Optional

from paged_jax.weights.base import check_role, weight_class


@weight_class
class DenseLinear:
    """``x @ w (+ b)``, ``w`` stored ``[in, out]`` (XLA's matmul)."""

    STATIC = ("parallel",)
    AXES = {"w": ("in", "out"), "b": ("out",)}
    w: Any
    b: Any = None
    parallel: Optional[str] = None

    def __post_init__(self):
        check_role(self.parallel)

    @property
    def in_features(self) -> int:
        return self.w.shape[0]

    def __call__(self, x):
        y = x @ self.w
        return y if self.b is None else y + self.b


@weight_class
class DenseEmbedding:
    """A token table ``[vocab, hidden]``; ``tied``: it is the LM head too (logits ``h @ table.T``)."""

    STATIC = ("tied", "parallel")
    AXES = {"table": ("vocab", None)}
    table: Any
    tied: bool = False
    parallel: Optional[str] = "vocab"

    def __post_init__(self):
        check_role(self.parallel)

    def lookup(self, ids):
        return self.table[ids]

    def logits(self, h):
        return h @ self.table.T
