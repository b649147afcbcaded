"""Attention variants a researcher writes: each is one file, a backend made from the reference
with a ``score_mod`` or ``mask_mod`` hook, registered under a name of its own::

    from paged_jax.attention import register_backend
    from paged_jax.attention.variants.soft_cap import soft_cap_backend

    register_backend(soft_cap_backend(30.0, name="cap-30"))
    LLM(model, attention_backend="cap-30")

The two here are examples of that pattern, registered by nobody. A model whose config has a
sliding window or a logit soft-cap (Mistral, Gemma 2) needs neither: those are
:class:`~paged_jax.attention.AttentionSpec` fields that every backend honours or refuses.
The hooks apply on top of the model's own spec.
"""

from paged_jax.attention.variants.sliding_window import sliding_window_attention, sliding_window_backend
from paged_jax.attention.variants.soft_cap import soft_cap_attention, soft_cap_backend

__all__ = ["sliding_window_attention", "sliding_window_backend", "soft_cap_attention", "soft_cap_backend"]
