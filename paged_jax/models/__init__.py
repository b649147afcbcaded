"""Pure-JAX model families and the one forward pass they share.

``forward(params, config, input_ids, positions, kv_caches, meta, attn)`` runs a
token-flat batch through the model, writing and reading K/V through the block
tables, and returns the final hidden states and the updated caches. Logits are
computed separately (``compute_logits``) for just the rows that need them.

A family is one file ending in ``FAMILY = ModelFamily(...)`` (:mod:`paged_jax.models.family`),
registered once in ``FAMILIES`` below.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_jax.attention import AttentionSpec, paged_attention_layer
from paged_jax.models import (gemma2, gemma3, gpt2, gpt_oss, llama, mistral, mixtral, opt, phi3, qwen2, qwen2_moe,
                              qwen3, qwen3_moe)
from paged_jax.errors import ModelLoadError
from paged_jax.models.config import ModelConfig, resolve_dtype
from paged_jax.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {m.FAMILY.name: m.FAMILY for m in (llama, opt, gpt2, qwen2, qwen3, mistral, gemma2, phi3,
                                                                     mixtral, qwen2_moe, qwen3_moe, gemma3, gpt_oss)}


def supported_architectures() -> list[str]:
    return sorted(a for fam in FAMILIES.values() for a in fam.architectures)


def family_of(cfg: dict, where: str) -> str:
    """The family claiming the config's ``architectures`` (or, without them, its ``model_type``)."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        for fam in FAMILIES.values():
            if arch in fam.architectures:
                return fam.name
    if archs:
        raise ModelLoadError(f"{where}: unsupported architecture {archs!r}; supported: {supported_architectures()}")
    model_type = cfg.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam.name
    raise ModelLoadError(
        f"{where}: unsupported model_type {model_type!r} (no 'architectures' given); "
        f"supported architectures: {supported_architectures()}")


def model_config_from_hf(cfg: dict, dtype: str = "auto", where: str = "model") -> ModelConfig:
    """Translate a parsed config.json into a ModelConfig (by its family's parser), with clear errors."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: config.json must hold a JSON object, got {type(cfg).__name__}")
    family = family_of(cfg, where)
    dt = resolve_dtype(dtype, cfg)
    try:
        return FAMILIES[family].config_from_hf(cfg, dt, where)
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: malformed config.json: {e}") from e


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What a family's layer calls as ``attn(q, k, v, kv_cache) -> (out, kv_cache)``: the step's paged
    attention through one layer's cache. ``spec`` (the layer's :class:`AttentionSpec`: scale, window,
    soft-cap) and ``meta`` (the step's metadata) are there for layers that need them: a RoPE per layer
    kind (Gemma 3), the step's real tokens (a mixture of experts skips padding)."""

    spec: AttentionSpec
    meta: Any
    backend: Any

    def __call__(self, q, k, v, kv_cache, sinks=None):  # sinks: the layer's sink logits, when spec.sinks
        return paged_attention_layer(q, k, v, kv_cache, meta=self.meta, spec=self.spec, backend=self.backend,
                                     sinks=sinks)


def forward(params, config: ModelConfig, input_ids, positions, kv_caches, meta, attn, rope_lengths=None,
            kv_layout=None):
    """``attn`` is the attention backend; each layer gets a :class:`LayerAttention` of it for the
    batch's metadata and the layer's :class:`AttentionSpec`. ``rope_lengths``: with dynamic-NTK RoPE,
    each token's rotation length. ``kv_layout`` (a :class:`~paged_jax.memory.KVLayout`; None: one
    cache array pair per layer, one block table): layer ``i`` reads and writes cache array
    ``layer_slot[i]`` through the block tables of its layer group ``layer_group[i]``."""
    fam = FAMILIES[config.family]
    h = fam.embed(params, config, input_ids, positions)
    # Dynamic NTK rotates each token for its own rotation length (the batch's, set from the request's
    # prompt length): the layers pass the pair on to apply_rope as they pass positions.
    layer_positions = (positions, rope_lengths) if config.rope_type == "dynamic" else positions
    grouped = kv_layout is not None and kv_layout.num_groups > 1
    new_caches = list(kv_caches)
    for i, lp in enumerate(params["layers"]):
        slot = i if kv_layout is None else kv_layout.layer_slot[i]
        layer_meta = meta.for_group(kv_layout.layer_group[i]) if grouped else meta
        layer_attn = LayerAttention(config.attention_spec(i), layer_meta, attn)
        h, new_caches[slot] = fam.layer(lp, config, h, layer_positions, new_caches[slot], layer_attn)
    return fam.final(params, config, h), new_caches


def compute_logits(params, config: ModelConfig, hidden):
    """Float32 logits: the LM head's, or a tied model's input embedding's (soft-capped if the config says so)."""
    import jax.numpy as jnp

    logits = params["lm_head"](hidden) if "lm_head" in params else params["embed"].logits(hidden)
    logits = logits.astype(jnp.float32)
    if config.final_logit_softcap is not None:
        logits = config.final_logit_softcap * jnp.tanh(logits / config.final_logit_softcap)
    return logits


__all__ = ["ModelConfig", "ModelFamily", "FAMILIES", "LayerAttention", "forward", "compute_logits", "model_config_from_hf",
           "supported_architectures"]
