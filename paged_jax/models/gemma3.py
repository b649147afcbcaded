"""Gemma 3 (text: ``Gemma3ForCausalLM``, the 1B model and the language part of the larger ones):
Gemma 2's layer (scaled embeddings, (1 + w) RMSNorms around attention and the MLP, GeGLU, the
softmax scale ``query_pre_attn_scalar ** -0.5``) with a (1 + w) RMSNorm over each head of Q and K
before the rotation, no soft-caps by default, and windows on five layers of six (``layer_types``, or
``sliding_window_pattern``). The two kinds of layer rotate differently: the global layers by
``rope_theta`` (1e6) with the config's RoPE scaling (linear, factor 8, on the larger models), the
sliding ones by ``rope_local_base_freq`` (1e4) unscaled; transformers 5 writes both in
``rope_parameters``, one entry per layer kind."""

from __future__ import annotations

import dataclasses

from paged_jax.errors import ModelLoadError
from paged_jax.models import gemma2
from paged_jax.models.config import ModelConfig, require
from paged_jax.models.family import ModelFamily


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    layers = int(require(cfg, "num_hidden_layers", where))
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                             for i in range(layers)]
    full, local = dict(cfg.get("rope_scaling") or {}), {}
    full_theta, local_theta = cfg.get("rope_theta", 1_000_000.0), cfg.get("rope_local_base_freq", 10_000.0)
    kinds = cfg.get("rope_parameters")
    if isinstance(kinds, dict) and ("full_attention" in kinds or "sliding_attention" in kinds):
        full, local = dict(kinds.get("full_attention") or {}), dict(kinds.get("sliding_attention") or {})
        full_theta = full.pop("rope_theta", full_theta)
        local_theta = local.pop("rope_theta", local_theta)
    if local.get("rope_type", "default") != "default" or len(set(local) - {"rope_type"}):
        raise ModelLoadError(f"{where}: RoPE scaling on the sliding-window layers ({local!r}) is not supported; "
                             "supported: scaling on the full-attention layers only")
    # Gemma 2's parser reads the full-attention layers' RoPE from rope_theta / rope_scaling.
    plain = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    plain.update(rope_theta=float(full_theta), rope_scaling=full or None, layer_types=layer_types)
    config = gemma2.config_from_hf(plain, dt, where, family="gemma3")
    return dataclasses.replace(config, sliding_rope_theta=float(local_theta))


def rope_of(c: ModelConfig, attn):
    """The RoPE of the layer ``attn`` serves: the sliding one on a windowed layer, the config's
    otherwise. (The layer knows its kind from its :class:`AttentionSpec`, ``attn.spec``: see
    :class:`paged_jax.models.LayerAttention`.)"""
    spec = attn.spec
    if spec.sliding_window is None:
        return c.rope_frequencies()
    return dataclasses.replace(c, rope_theta=c.sliding_rope_theta, rope_scaling=None).rope_frequencies()


def hf_tensor_shapes(c) -> dict[str, tuple]:
    shapes = gemma2.hf_tensor_shapes(c)
    for i in range(c.num_layers):
        for name in ("q_norm", "k_norm"):
            shapes[f"model.layers.{i}.self_attn.{name}.weight"] = (c.head_dim,)
    return shapes


def params_from_hf(c, get, lin) -> dict:
    params = gemma2.params_from_hf(c, get, lin)
    for i, lp in enumerate(params["layers"]):
        p = f"model.layers.{i}.self_attn."
        lp["q_norm"], lp["k_norm"] = get(p + "q_norm.weight"), get(p + "k_norm.weight")
    return params


def layer(lp, c, h, positions, kv, attn):
    return gemma2.layer(lp, c, h, positions, kv, attn, rope=rope_of(c, attn))


FAMILY = ModelFamily(
    name="gemma3", architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=gemma2.embed, layer=layer, final=gemma2.final,
    # a window of 8, so that short prompts already cross it
    tiny_config=dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=64,
                     intermediate_size=176, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, rope_local_base_freq=10000.0, tie_word_embeddings=True,
                     hidden_activation="gelu_pytorch_tanh", sliding_window=8, sliding_window_pattern=6),
    tiny_tokens=dict(bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>", add_bos=True))
