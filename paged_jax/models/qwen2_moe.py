"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on Q/K/V where ``qkv_bias``
says, by default) and, on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick, a
mixture of ``num_experts`` SwiGLU experts (``moe_intermediate_size`` wide), top
``num_experts_per_tok`` by softmax score, renormalised if ``norm_topk_prob``, plus a shared expert
(``shared_expert_intermediate_size``) scaled by the sigmoid of its own gate
(:mod:`paged_jax.models.moe`); the other layers have a dense MLP (``intermediate_size``)."""

from __future__ import annotations

import dataclasses

from paged_jax.models import llama, moe, qwen2
from paged_jax.models.config import ModelConfig, require
from paged_jax.models.family import ModelFamily

NAMES = moe.ExpertNames()


def experts_config(cfg: dict, where: str, shared: bool):
    """The MoEConfig of a Qwen MoE config.json (None when no layer has experts); ``shared``: a gated
    shared expert (Qwen2-MoE)."""
    layers = int(require(cfg, "num_hidden_layers", where))
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    if not sparse:
        return None
    extra = dict(shared_intermediate_size=int(require(cfg, "shared_expert_intermediate_size", where)),
                 shared_expert_gate=True) if shared else {}
    return moe.moe_config(cfg, where, layers, num_experts=num_experts,
                          intermediate_size=int(require(cfg, "moe_intermediate_size", where)),
                          renormalize=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse, **extra)


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    layers = int(require(cfg, "num_hidden_layers", where))
    cfg = dict(cfg, attention_bias=bool(cfg.get("qkv_bias", True)))
    if cfg.get("use_sliding_window") and not cfg.get("layer_types"):  # transformers' rule for Qwen2-MoE
        window_layers = int(cfg.get("max_window_layers", layers))
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % 2 and i < window_layers else "full_attention"
                              for i in range(layers)]
    config = qwen2.config_from_hf(cfg, dt, where, family="qwen2_moe")
    return dataclasses.replace(config, moe=experts_config(cfg, where, shared=True))


def hf_tensor_shapes(c) -> dict[str, tuple]:
    shapes = llama.hf_tensor_shapes(c, qkv_bias=c.attention_bias, o_bias=False)
    return shapes if c.moe is None else moe.hf_tensor_shapes(c, shapes, NAMES)


def params_from_hf(c, get, lin) -> dict:
    return llama.params_from_hf(c, get, lin, mlp=None if c.moe is None else moe.moe_params(c, get, lin, NAMES))


FAMILY = ModelFamily(
    name="qwen2_moe", architectures=("Qwen2MoeForCausalLM",), model_types=("qwen2_moe",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=llama.embed, layer=moe.layer, final=llama.final,
    tiny_config=dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=64,
                     intermediate_size=176, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                     num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                     mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False),
    tiny_tokens=dict(bos="<|endoftext|>", eos="<|endoftext|>", unk="<unk>", pad=None, add_bos=False))
