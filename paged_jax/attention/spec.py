"""AttentionSpec: what one attention layer computes, as the model config says.

Static and hashable (jit sees it as a constant). Every backend receives it with each
call and must honour every field it carries, or refuse at engine start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AttentionSpec:
    scale: float  # multiplies q . k before the softmax
    sliding_window: Optional[int] = None  # a query at position p sees keys p - window + 1 .. p
    logit_soft_cap: Optional[float] = None  # scores become cap * tanh(scores / cap) before the softmax
