"""GPT-2: learned positions, Conv1D weights (already [in, out]), gelu_new."""

from __future__ import annotations

import jax.numpy as jnp

from paged_jax.models.layers import ACTIVATIONS, embed_rows, layer_norm, linear, split_heads


def hf_tensor_shapes(c) -> dict[str, tuple]:
    H, F = c.hidden_size, c.intermediate_size
    shapes = {"transformer.wte.weight": (c.vocab_size, H), "transformer.wpe.weight": (c.max_position_embeddings, H),
              "transformer.ln_f.weight": (H,), "transformer.ln_f.bias": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"transformer.h.{i}."
        for name, shape in (("attn.c_attn", (H, 3 * H)), ("attn.c_proj", (H, H)),
                            ("mlp.c_fc", (H, F)), ("mlp.c_proj", (F, H))):
            shapes[p + name + ".weight"] = shape  # Conv1D: [in, out]
            shapes[p + name + ".bias"] = (shape[1],)
        for ln in ("ln_1", "ln_2"):
            shapes[p + ln + ".weight"] = (H,)
            shapes[p + ln + ".bias"] = (H,)
    return shapes


def params_from_hf(c, get, lin) -> dict:
    def conv1d(prefix):  # Conv1D stores [in, out]: no transpose
        return {"w": get(prefix + ".weight"), "b": get(prefix + ".bias")}

    def ln(prefix):
        return {"w": get(prefix + ".weight"), "b": get(prefix + ".bias")}

    layers = []
    for i in range(c.num_layers):
        p = f"transformer.h.{i}."
        layers.append({"ln1": ln(p + "ln_1"), "ln2": ln(p + "ln_2"), "qkv": conv1d(p + "attn.c_attn"),
                       "o": conv1d(p + "attn.c_proj"), "fc": conv1d(p + "mlp.c_fc"), "proj": conv1d(p + "mlp.c_proj")})
    params = {"embed": get("transformer.wte.weight"), "pos": get("transformer.wpe.weight"),
              "final_ln": ln("transformer.ln_f"), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return params


def embed(params, c, input_ids, positions):
    return embed_rows(params, input_ids, c.vocab_size) + params["pos"][positions]


def layer(lp, c, h, positions, kv, attn):
    x = layer_norm(h, lp["ln1"], c.norm_eps)
    q, k, v = jnp.split(linear(x, lp["qkv"]), 3, axis=-1)
    q, k, v = (split_heads(t, c.num_heads, c.head_dim) for t in (q, k, v))
    o, kv = attn(q, k, v, kv)
    h = h + linear(o.reshape(o.shape[0], -1), lp["o"])
    x = layer_norm(h, lp["ln2"], c.norm_eps)
    return h + linear(ACTIVATIONS[c.activation](linear(x, lp["fc"])), lp["proj"]), kv


def final(params, c, h):
    return layer_norm(h, params["final_ln"], c.norm_eps)
