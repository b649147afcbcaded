"""Gemma 2: embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and after both attention
and the MLP, GeGLU (tanh GELU), softmax scale ``query_pre_attn_scalar ** -0.5``, tanh soft-caps
on the attention scores and on the final logits, and a sliding window on alternating layers
(transformers' ``layer_types``; by default the even layers). The tensors are LLaMA's plus two
norms per layer; the layer is its own (the norms sit elsewhere)."""

from __future__ import annotations

import jax.numpy as jnp

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama
from paged_jax.models.config import ModelConfig, check_layer_types
from paged_jax.models.family import ModelFamily
from paged_jax.models.layers import ACTIVATIONS, apply_rope, linear, project, rms_norm, split_heads

def _optional_float(cfg: dict, key: str):
    return None if cfg.get(key) is None else float(cfg[key])


def config_from_hf(cfg: dict, dt: str, where: str, family: str = "gemma2", **extra) -> ModelConfig:
    """``family``, ``extra``: for Gemma 3, which reads the same fields."""
    num_layers = int(cfg.get("num_hidden_layers", 0))
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(num_layers)]
    check_layer_types(layer_types, num_layers, where)
    if window is not None and int(window) < 1:
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer, got {window}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{where}: use_bidirectional_attention is not supported; supported: causal attention")
    scalar = float(cfg.get("query_pre_attn_scalar", 256))
    return llama.config_from_hf(
        cfg, dt, where, family=family, activations=("gelu_pytorch_tanh",),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=None if window is None else int(window), layer_types=tuple(layer_types),
        attention_scale=scalar ** -0.5, attn_logit_softcap=_optional_float(cfg, "attn_logit_softcapping"),
        final_logit_softcap=_optional_float(cfg, "final_logit_softcapping"), **extra)


def hf_tensor_shapes(c) -> dict[str, tuple]:
    shapes = llama.hf_tensor_shapes(c)
    for i in range(c.num_layers):
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[f"model.layers.{i}.{name}.weight"] = (c.hidden_size,)
    return shapes


def params_from_hf(c, get, lin) -> dict:
    # LLaMA's ln1 / ln2 are Gemma's input / post-attention norms; the MLP's two norms are added.
    params = llama.params_from_hf(c, get, lin)
    for i, lp in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        lp["ln3"], lp["ln4"] = get(p + "pre_feedforward_layernorm.weight"), get(p + "post_feedforward_layernorm.weight")
    return params


def norm(x, w, c):
    """Gemma's RMSNorm: the weight is stored as an offset from one, applied in float32."""
    return rms_norm(x, 1.0 + w.astype(jnp.float32), c.norm_eps, c.native_norm)


def embed(params, c, input_ids, positions):
    table_rows = params["embed"].lookup(input_ids)
    return table_rows * jnp.asarray(c.hidden_size ** 0.5, table_rows.dtype)


def layer(lp, c, h, positions, kv, attn, rope=None):
    """``rope``: the layer's RoPE where it is not the config's (Gemma 3's sliding layers)."""
    x = norm(h, lp["ln1"], c)
    rope = c.rope_frequencies() if rope is None else rope
    q, k, v = project(x, lp, "q", "k", "v")
    q, k = split_heads(q, c.num_heads, c.head_dim), split_heads(k, c.num_kv_heads, c.head_dim)
    if "q_norm" in lp:  # Gemma 3: a (1 + w) RMSNorm over each head of Q and K, before the rotation
        q, k = norm(q, lp["q_norm"], c), norm(k, lp["k_norm"], c)
    q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
    o, kv = attn(q, k, split_heads(v, c.num_kv_heads, c.head_dim), kv)
    h = h + norm(linear(o.reshape(o.shape[0], -1), lp["o"]), lp["ln2"], c)
    x = norm(h, lp["ln3"], c)
    gate, up = project(x, lp, "gate", "up")
    x = linear(ACTIVATIONS[c.activation](gate) * up, lp["down"])
    return h + norm(x, lp["ln4"], c), kv


def final(params, c, h):
    return norm(h, params["norm"], c)


FAMILY = ModelFamily(
    name="gemma2", architectures=("Gemma2ForCausalLM",), model_types=("gemma2",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=embed, layer=layer, final=final,
    tiny_config=dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=64,
                     intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                     rope_theta=10000.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                     sliding_window=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    tiny_tokens=dict(bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>", add_bos=True))
