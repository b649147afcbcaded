"""Mixtral (8x7B, 8x22B): Mistral's attention (one sliding window on every layer, or none) and, on
every layer, a mixture of ``num_local_experts`` SwiGLU experts, ``num_experts_per_tok`` of them per
token, their softmax scores renormalised over the chosen ones (:mod:`paged_jax.models.moe`). The
checkpoint keeps the mixture under ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up),
``w2`` (down)."""

from __future__ import annotations

from paged_jax.models import llama, mistral, moe
from paged_jax.models.config import ModelConfig, require
from paged_jax.models.family import ModelFamily

NAMES = moe.ExpertNames(block="block_sparse_moe.", expert=("w1", "w3", "w2"))


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    layers = int(require(cfg, "num_hidden_layers", where))
    experts = moe.moe_config(cfg, where, layers, num_experts=int(require(cfg, "num_local_experts", where)),
                             intermediate_size=int(require(cfg, "intermediate_size", where)), renormalize=True,
                             sparse_layers=tuple(range(layers)))
    return mistral.config_from_hf(cfg, dt, where, family="mixtral", moe=experts)


def hf_tensor_shapes(c) -> dict[str, tuple]:
    return moe.hf_tensor_shapes(c, llama.hf_tensor_shapes(c), NAMES)


def params_from_hf(c, get, lin) -> dict:
    return llama.params_from_hf(c, get, lin, mlp=moe.moe_params(c, get, lin, NAMES))


FAMILY = ModelFamily(
    name="mixtral", architectures=("MixtralForCausalLM",), model_types=("mixtral",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=llama.embed, layer=moe.layer, final=llama.final,
    tiny_config=dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64,
                     intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                     rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", sliding_window=None),
    tiny_tokens=dict(bos="<s>", eos="</s>", unk="<unk>", pad=None, add_bos=True))
