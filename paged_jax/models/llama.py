"""LLaMA family (LLaMA 1/2/3, Vicuna): RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""

from __future__ import annotations

import jax

from paged_jax.errors import ModelLoadError
from paged_jax.models.config import ModelConfig, eos_tuple, require, rope_from_hf
from paged_jax.models.family import ModelFamily
from paged_jax.models.layers import apply_rope, linear, project, rms_norm, split_heads
from paged_jax.weights import DenseEmbedding


def config_from_hf(cfg: dict, dt: str, where: str, family: str = "llama", activations: tuple = ("silu",),
                   **extra) -> ModelConfig:
    """LLaMA's config.json fields; ``family``, the ``activations`` it supports and ``extra`` fields
    for families built on it (Qwen2, Gemma 2)."""
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or activations[0]
    if act not in activations:
        raise ModelLoadError(f"{where}: hidden activation {act!r} is not supported for {family}; "
                             f"supported: {list(activations)}")
    if int(cfg.get("pretraining_tp", 1)) != 1:
        raise ModelLoadError(f"{where}: pretraining_tp={cfg['pretraining_tp']} is not supported; supported: 1")
    theta, scaling = rope_from_hf(cfg, where)
    fields = dict(
        family=family, vocab_size=int(require(cfg, "vocab_size", where)), hidden_size=hidden,
        num_layers=int(require(cfg, "num_hidden_layers", where)), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=int(require(cfg, "intermediate_size", where)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), activation=act,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype=dt,
        rope_theta=theta, rope_scaling=scaling, attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos_tuple(cfg.get("eos_token_id")))
    config = ModelConfig(**{**fields, **extra})
    pairs = int(config.head_dim * dict(scaling or ()).get("partial_rotary_factor", 1.0)) // 2
    for name in ("short_factor", "long_factor"):
        factors = dict(scaling or ()).get(name)
        if factors is not None and len(factors) != pairs:
            raise ModelLoadError(f"{where}: rope scaling {name} has {len(factors)} entries; the rotated part of "
                                 f"each head needs {pairs} (one per pair of rotated dims)")
    return config


def hf_tensor_shapes(c, qkv_bias: bool = None, o_bias: bool = None) -> dict[str, tuple]:
    """``qkv_bias`` / ``o_bias`` default to ``attention_bias`` (Qwen2 has the first only)."""
    qkv_bias = c.attention_bias if qkv_bias is None else qkv_bias
    o_bias = c.attention_bias if o_bias is None else o_bias
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, out_dim in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (out_dim, c.hidden_size)
            if qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        for name, shape in (("gate_proj", (c.intermediate_size, c.hidden_size)),
                            ("up_proj", (c.intermediate_size, c.hidden_size)),
                            ("down_proj", (c.hidden_size, c.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    return shapes


def params_from_hf(c, get, lin, mlp=None) -> dict:
    """``mlp(i, prefix)``: layer ``i``'s MLP params (default LLaMA's gate / up / down; the
    mixture-of-experts families give their own)."""
    mlp = mlp or (lambda i, p: mlp_params(lin, p + "mlp."))
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        layers.append({
            "ln1": get(p + "input_layernorm.weight"), "ln2": get(p + "post_attention_layernorm.weight"),
            "q": lin(p + "self_attn.q_proj", "column"), "k": lin(p + "self_attn.k_proj", "kv"),
            "v": lin(p + "self_attn.v_proj", "kv"), "o": lin(p + "self_attn.o_proj", "row"),
            **mlp(i, p),
        })
    params = {"embed": DenseEmbedding(get("model.embed_tokens.weight"), tied=c.tie_word_embeddings),
              "norm": get("model.norm.weight"), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = lin("lm_head", "column")
    return params


def mlp_params(lin, prefix: str) -> dict:
    """A SwiGLU MLP's linears, from ``{prefix}gate_proj`` / ``up_proj`` / ``down_proj``."""
    return {"gate": lin(prefix + "gate_proj", "column"), "up": lin(prefix + "up_proj", "column"),
            "down": lin(prefix + "down_proj", "row")}


def embed(params, c, input_ids, positions):
    return params["embed"].lookup(input_ids)


def attention(lp, c, h, positions, kv, attn):
    """The layer's first half: ``h`` plus self-attention of its normed input."""
    x = rms_norm(h, lp["ln1"], c.norm_eps, c.native_norm)
    rope = c.rope_frequencies()
    q, k, v = project(x, lp, "q", "k", "v")
    q, k = split_heads(q, c.num_heads, c.head_dim), split_heads(k, c.num_kv_heads, c.head_dim)
    if "q_norm" in lp:  # Qwen3: an RMSNorm over each head of Q and K, before the rotation
        q = rms_norm(q, lp["q_norm"], c.norm_eps, c.native_norm)
        k = rms_norm(k, lp["k_norm"], c.norm_eps, c.native_norm)
    q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
    o, kv = attn(q, k, split_heads(v, c.num_kv_heads, c.head_dim), kv)
    return h + linear(o.reshape(o.shape[0], -1), lp["o"]), kv


def mlp(lp, x):
    """SwiGLU."""
    gate, up = project(x, lp, "gate", "up")
    return linear(jax.nn.silu(gate) * up, lp["down"])


def layer(lp, c, h, positions, kv, attn):
    h, kv = attention(lp, c, h, positions, kv, attn)
    return h + mlp(lp, rms_norm(h, lp["ln2"], c.norm_eps, c.native_norm)), kv


def final(params, c, h):
    return rms_norm(h, params["norm"], c.norm_eps, c.native_norm)


FAMILY = ModelFamily(
    name="llama", architectures=("LlamaForCausalLM",), model_types=("llama",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=embed, layer=layer, final=final,
    tiny_config=dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=176,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=False, hidden_act="silu"),
    tiny_tokens=dict(bos="<s>", eos="</s>", unk="<unk>", pad=None, add_bos=True))
