"""AttentionSpec: what one attention layer computes, as the model config says.

Static and hashable (jit sees it as a constant). Every backend receives it with each
call and must honour every field it carries, or refuse at engine start: a backend declares
the fields it honours (``spec_fields``), and selection refuses a spec whose non-default fields
(:func:`non_default_fields`) it has not declared, so a field added here is refused by every backend
until the backend says it honours it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AttentionSpec:
    scale: float  # multiplies q . k before the softmax
    sliding_window: Optional[int] = None  # a query at position p sees keys p - window + 1 .. p
    logit_soft_cap: Optional[float] = None  # scores become cap * tanh(scores / cap) before the softmax
    # Attention sinks (gpt-oss): a learned logit per query head joins each softmax's denominator (a key
    # no query's value comes from), so a head may attend to nothing. The values are weights, not
    # config: the layer passes them with each call, ``sinks`` float32 [num_heads], to backends that
    # declare this field.
    sinks: bool = False


def non_default_fields(spec) -> tuple[str, ...]:
    """The fields of ``spec`` that change what attention computes: every field but ``scale`` (which
    every backend applies) whose value differs from its default."""
    return tuple(f.name for f in dataclasses.fields(spec)
                 if f.name != "scale" and getattr(spec, f.name) != f.default)


ALL_FIELDS = frozenset(f.name for f in dataclasses.fields(AttentionSpec)) - {"scale"}
