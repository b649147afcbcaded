"""LLaMA family (LLaMA 1/2/3, Vicuna): RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""

from __future__ import annotations

from paged_jax.models.layers import apply_rope, embed_rows, linear, rms_norm, split_heads
import jax


def hf_tensor_shapes(c) -> dict[str, tuple]:
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
            if c.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q)
        if c.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        for name, shape in (("gate_proj", (c.intermediate_size, c.hidden_size)),
                            ("up_proj", (c.intermediate_size, c.hidden_size)),
                            ("down_proj", (c.hidden_size, c.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    return shapes


def params_from_hf(c, get, lin) -> dict:
    """``get(name)`` returns an HF tensor; ``lin(prefix)`` a transposed linear layer."""
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        layers.append({
            "ln1": get(p + "input_layernorm.weight"), "ln2": get(p + "post_attention_layernorm.weight"),
            "q": lin(p + "self_attn.q_proj"), "k": lin(p + "self_attn.k_proj"), "v": lin(p + "self_attn.v_proj"),
            "o": lin(p + "self_attn.o_proj"), "gate": lin(p + "mlp.gate_proj"), "up": lin(p + "mlp.up_proj"),
            "down": lin(p + "mlp.down_proj"),
        })
    params = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight"), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return params


def embed(params, c, input_ids, positions):
    return embed_rows(params, input_ids, c.vocab_size)


def layer(lp, c, h, positions, kv, attn):
    x = rms_norm(h, lp["ln1"], c.norm_eps)
    inv_freq = c.rope_inv_freq()
    q = apply_rope(split_heads(linear(x, lp["q"]), c.num_heads, c.head_dim), positions, inv_freq)
    k = apply_rope(split_heads(linear(x, lp["k"]), c.num_kv_heads, c.head_dim), positions, inv_freq)
    v = split_heads(linear(x, lp["v"]), c.num_kv_heads, c.head_dim)
    o, kv = attn(q, k, v, kv)
    h = h + linear(o.reshape(o.shape[0], -1), lp["o"])
    x = rms_norm(h, lp["ln2"], c.norm_eps)
    h = h + linear(jax.nn.silu(linear(x, lp["gate"])) * linear(x, lp["up"]), lp["down"])
    return h, kv


def final(params, c, h):
    return rms_norm(h, params["norm"], c.norm_eps)
