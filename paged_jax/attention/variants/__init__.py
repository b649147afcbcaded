"""Attention variants: each is one function in one file plus a ``register_backend`` call.

Importing this package registers ``"soft-cap"`` (tanh logit soft-capping, as in Gemma 2)
and ``"sliding-window"`` (each query sees the last ``window`` positions, as in Mistral).
Both reuse the reference through its ``score_mod`` / ``mask_mod`` hooks.
"""

from paged_jax.attention.variants.sliding_window import sliding_window_attention
from paged_jax.attention.variants.soft_cap import soft_cap_attention

__all__ = ["sliding_window_attention", "soft_cap_attention"]
