"""Pure-JAX model families and the one forward pass they share.

``forward(params, config, input_ids, positions, kv_caches, meta, attn)`` runs a
token-flat batch through the model, writing and reading K/V through the block
tables, and returns the final hidden states and the updated caches. Logits are
computed separately (``compute_logits``) for just the rows that need them.
"""

from __future__ import annotations

import functools
from types import ModuleType

from paged_jax.attention import paged_attention_layer
from paged_jax.models import gpt2, llama, opt
from paged_jax.models.config import ModelConfig

FAMILIES: dict[str, ModuleType] = {"llama": llama, "opt": opt, "gpt2": gpt2}


def forward(params, config: ModelConfig, input_ids, positions, kv_caches, meta, attn):
    """``attn`` is the attention backend; each layer gets it bound to the batch's metadata and
    the layer's :class:`AttentionSpec`, as ``attn(q, k, v, kv_cache) -> (out, kv_cache)``."""
    fam = FAMILIES[config.family]
    h = fam.embed(params, config, input_ids, positions)
    new_caches = []
    for i, (lp, kv) in enumerate(zip(params["layers"], kv_caches)):
        layer_attn = functools.partial(paged_attention_layer, meta=meta, spec=config.attention_spec(i), backend=attn)
        h, kv = fam.layer(lp, config, h, positions, kv, layer_attn)
        new_caches.append(kv)
    return fam.final(params, config, h), new_caches


def compute_logits(params, config: ModelConfig, hidden):
    """Float32 logits; tied models reuse the input embedding."""
    import jax.numpy as jnp

    panels = params.get("lm_head_panels", params.get("embed_panels"))
    if panels is not None:  # packed for the native matmul (paged_jax.native.pack_params), vocabulary padded
        from paged_jax import native

        logits = native.linear(hidden, panels)[..., :config.vocab_size]
    elif "lm_head" in params:
        logits = hidden @ params["lm_head"]
    else:
        logits = hidden @ params["embed"].T
    return logits.astype(jnp.float32)


__all__ = ["ModelConfig", "FAMILIES", "forward", "compute_logits"]
