"""Logit soft-capping as a variant: scores become ``cap * tanh(scores / cap)`` before the softmax."""

from paged_jax.attention.backends import ReferenceBackend, soft_cap_mod
from paged_jax.attention.reference import paged_attention_reference


def soft_cap_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *, cap: float):
    """The reference with the cap's ``score_mod`` (q [S, Q, H, D], see ``paged_attention_reference``)."""
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale,
                                     score_mod=soft_cap_mod(cap))


def soft_cap_backend(cap: float, name: str = "soft-cap") -> ReferenceBackend:
    """A backend to ``register_backend``: the reference with every score soft-capped at ``cap``."""
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
        raise ValueError(f"cap must be a number > 0, got {cap!r}")
    return ReferenceBackend(name, score_mod=soft_cap_mod(float(cap)))
