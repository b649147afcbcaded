"""Qwen3 (dense): LLaMA's layer with an RMSNorm over each head of Q and K before the rotation
(``q_norm``, ``k_norm``), an explicit ``head_dim``, biases only where ``attention_bias`` says,
and Qwen2's optional sliding window (``use_sliding_window``, ``layer_types``)."""

from __future__ import annotations

import functools

from paged_jax.models import llama, qwen2
from paged_jax.models.family import ModelFamily


def hf_tensor_shapes(c) -> dict[str, tuple]:
    shapes = llama.hf_tensor_shapes(c)
    for i in range(c.num_layers):
        for name in ("q_norm", "k_norm"):
            shapes[f"model.layers.{i}.self_attn.{name}.weight"] = (c.head_dim,)
    return shapes


def params_from_hf(c, get, lin, mlp=None) -> dict:
    """``mlp``: as :func:`paged_jax.models.llama.params_from_hf` takes it (Qwen3-MoE's experts)."""
    params = llama.params_from_hf(c, get, lin, mlp)
    for i, lp in enumerate(params["layers"]):
        p = f"model.layers.{i}.self_attn."
        lp["q_norm"], lp["k_norm"] = get(p + "q_norm.weight"), get(p + "k_norm.weight")
    return params


FAMILY = ModelFamily(
    name="qwen3", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",),
    config_from_hf=functools.partial(qwen2.config_from_hf, family="qwen3"), hf_tensor_shapes=hf_tensor_shapes,
    params_from_hf=params_from_hf, embed=llama.embed, layer=llama.layer, final=llama.final,
    tiny_config=dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
                     intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=True, hidden_act="silu", attention_bias=False, use_sliding_window=False),
    tiny_tokens=dict(bos="<|endoftext|>", eos="<|endoftext|>", unk="<unk>", pad=None, add_bos=False))
