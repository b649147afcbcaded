"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (a per-head RMSNorm on Q and K, an
explicit ``head_dim``, biases where ``attention_bias`` says; with ``use_sliding_window``, one window on
every layer) and Qwen2-MoE's mixture without the shared expert (:mod:`paged_jax.models.moe`)."""

from __future__ import annotations

import dataclasses

from paged_jax.models import llama, moe, qwen2, qwen2_moe, qwen3
from paged_jax.models.config import ModelConfig, require
from paged_jax.models.family import ModelFamily


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    layers = int(require(cfg, "num_hidden_layers", where))
    if cfg.get("use_sliding_window") and not cfg.get("layer_types"):  # transformers' Qwen3-MoE: every layer
        cfg = dict(cfg, layer_types=["sliding_attention"] * layers)
    config = qwen2.config_from_hf(cfg, dt, where, family="qwen3_moe")
    return dataclasses.replace(config, moe=qwen2_moe.experts_config(cfg, where, shared=False))


def hf_tensor_shapes(c) -> dict[str, tuple]:
    shapes = qwen3.hf_tensor_shapes(c)
    return shapes if c.moe is None else moe.hf_tensor_shapes(c, shapes, qwen2_moe.NAMES)


def params_from_hf(c, get, lin) -> dict:
    return qwen3.params_from_hf(c, get, lin, mlp=None if c.moe is None else moe.moe_params(c, get, lin, qwen2_moe.NAMES))


FAMILY = ModelFamily(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=llama.embed, layer=moe.layer, final=llama.final,
    tiny_config=dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                     intermediate_size=176, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                     attention_bias=False, use_sliding_window=False),
    tiny_tokens=dict(bos="<|endoftext|>", eos="<|endoftext|>", unk="<unk>", pad=None, add_bos=False))
