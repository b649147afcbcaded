"""Sliding-window attention (Mistral): query at position ``p`` sees positions ``p - window + 1 .. p``."""

from paged_jax.attention import paged_attention_reference, register_backend


def sliding_window_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *,
                             window: int = 4096):
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale,
                                     mask_mod=lambda q_pos, k_pos: k_pos > q_pos - window)


register_backend("sliding-window", sliding_window_attention)
