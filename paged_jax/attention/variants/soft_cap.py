"""Logit soft-capping (Gemma 2): scores become ``cap * tanh(scores / cap)`` before the softmax."""

import jax.numpy as jnp

from paged_jax.attention import paged_attention_reference, register_backend


def soft_cap_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *, cap: float = 50.0):
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale,
                                     score_mod=lambda s, q_pos, k_pos: cap * jnp.tanh(s / cap))


register_backend("soft-cap", soft_cap_attention)
