"""Sliding-window attention as a variant: query at position ``p`` sees positions ``p - window + 1 .. p``."""

from paged_jax.attention.backends import ReferenceBackend, window_mask_mod
from paged_jax.attention.reference import paged_attention_reference


def sliding_window_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *, window: int):
    """The reference with the window's ``mask_mod`` (q [S, Q, H, D], see ``paged_attention_reference``)."""
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale,
                                     mask_mod=window_mask_mod(window))


def sliding_window_backend(window: int, name: str = "sliding-window") -> ReferenceBackend:
    """A backend to ``register_backend``: the reference, each query seeing its last ``window`` positions."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    return ReferenceBackend(name, mask_mod=window_mask_mod(window))
