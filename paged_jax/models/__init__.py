"""Pure-JAX model families and the one forward pass they share.

``forward(params, config, input_ids, positions, kv_caches, meta, attn)`` runs a
token-flat batch through the model, writing and reading K/V through the block
tables, and returns the final hidden states and the updated caches. Logits are
computed separately (``compute_logits``) for just the rows that need them.

A family is one file ending in ``FAMILY = ModelFamily(...)`` (:mod:`paged_jax.models.family`),
registered once in ``FAMILIES`` below.
"""

from __future__ import annotations

import functools

from paged_jax.attention import paged_attention_layer
from paged_jax.models import (gemma2, gemma3, gpt2, llama, mistral, mixtral, opt, phi3, qwen2, qwen2_moe, qwen3,
                              qwen3_moe)
from paged_jax.models.config import ModelConfig
from paged_jax.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {m.FAMILY.name: m.FAMILY for m in (llama, opt, gpt2, qwen2, qwen3, mistral, gemma2, phi3,
                                                                     mixtral, qwen2_moe, qwen3_moe, gemma3)}


def forward(params, config: ModelConfig, input_ids, positions, kv_caches, meta, attn):
    """``attn`` is the attention backend; each layer gets it bound to the batch's metadata and
    the layer's :class:`AttentionSpec`, as ``attn(q, k, v, kv_cache) -> (out, kv_cache)``."""
    fam = FAMILIES[config.family]
    h = fam.embed(params, config, input_ids, positions)
    # Dynamic NTK rotates each token for its own rotation length (the batch's, set from the request's
    # prompt length): the layers pass the pair on to apply_rope as they pass positions.
    layer_positions = (positions, meta.rope_lengths) if config.rope_type == "dynamic" else positions
    new_caches = []
    for i, (lp, kv) in enumerate(zip(params["layers"], kv_caches)):
        layer_attn = functools.partial(paged_attention_layer, meta=meta, spec=config.attention_spec(i), backend=attn)
        h, kv = fam.layer(lp, config, h, layer_positions, kv, layer_attn)
        new_caches.append(kv)
    return fam.final(params, config, h), new_caches


def compute_logits(params, config: ModelConfig, hidden):
    """Float32 logits: the LM head's, or a tied model's input embedding's (soft-capped if the config says so)."""
    import jax.numpy as jnp

    logits = params["lm_head"](hidden) if "lm_head" in params else params["embed"].logits(hidden)
    logits = logits.astype(jnp.float32)
    if config.final_logit_softcap is not None:
        logits = config.final_logit_softcap * jnp.tanh(logits / config.final_logit_softcap)
    return logits


__all__ = ["ModelConfig", "ModelFamily", "FAMILIES", "forward", "compute_logits"]
