"""OPT: learned positions (offset 2), pre- or post-LayerNorm, ReLU FFN, optional project_in/out."""

from __future__ import annotations

from paged_jax.models.layers import ACTIVATIONS, embed_rows, layer_norm, linear, split_heads

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


def hf_tensor_shapes(c) -> dict[str, tuple]:
    H, F = c.hidden_size, c.intermediate_size
    E = c.word_embed_proj_dim or H
    d = "model.decoder."
    shapes = {d + "embed_tokens.weight": (c.vocab_size, E),
              d + "embed_positions.weight": (c.max_position_embeddings + POSITION_OFFSET, H)}
    if c.word_embed_proj_dim:
        shapes[d + "project_in.weight"] = (H, E)
        shapes[d + "project_out.weight"] = (E, H)
    if c.has_final_layer_norm:
        shapes[d + "final_layer_norm.weight"] = (H,)
        shapes[d + "final_layer_norm.bias"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    for i in range(c.num_layers):
        p = f"{d}layers.{i}."
        for name, shape in (("self_attn.q_proj", (H, H)), ("self_attn.k_proj", (H, H)), ("self_attn.v_proj", (H, H)),
                            ("self_attn.out_proj", (H, H)), ("fc1", (F, H)), ("fc2", (H, F))):
            shapes[p + name + ".weight"] = shape
            if c.enable_bias:
                shapes[p + name + ".bias"] = (shape[0],)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[p + ln + ".weight"] = (H,)
            shapes[p + ln + ".bias"] = (H,)
    return shapes


def _ln(get, prefix):
    return {"w": get(prefix + ".weight"), "b": get(prefix + ".bias")}


def params_from_hf(c, get, lin) -> dict:
    d = "model.decoder."
    layers = []
    for i in range(c.num_layers):
        p = f"{d}layers.{i}."
        layers.append({
            "ln1": _ln(get, p + "self_attn_layer_norm"), "ln2": _ln(get, p + "final_layer_norm"),
            "q": lin(p + "self_attn.q_proj"), "k": lin(p + "self_attn.k_proj"), "v": lin(p + "self_attn.v_proj"),
            "o": lin(p + "self_attn.out_proj"), "fc1": lin(p + "fc1"), "fc2": lin(p + "fc2"),
        })
    params = {"embed": get(d + "embed_tokens.weight"), "pos": get(d + "embed_positions.weight"), "layers": layers}
    if c.word_embed_proj_dim:
        params["project_in"] = lin(d + "project_in")
        params["project_out"] = lin(d + "project_out")
    if c.has_final_layer_norm:
        params["final_ln"] = _ln(get, d + "final_layer_norm")
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return params


def embed(params, c, input_ids, positions):
    h = embed_rows(params, input_ids, c.vocab_size)
    if c.word_embed_proj_dim:
        h = linear(h, params["project_in"])
    return h + params["pos"][positions + POSITION_OFFSET]


def layer(lp, c, h, positions, kv, attn):
    pre = c.do_layer_norm_before
    x = layer_norm(h, lp["ln1"], c.norm_eps) if pre else h
    q = split_heads(linear(x, lp["q"]), c.num_heads, c.head_dim)
    k = split_heads(linear(x, lp["k"]), c.num_kv_heads, c.head_dim)
    v = split_heads(linear(x, lp["v"]), c.num_kv_heads, c.head_dim)
    o, kv = attn(q, k, v, kv)
    h = h + linear(o.reshape(o.shape[0], -1), lp["o"])
    if not pre:
        h = layer_norm(h, lp["ln1"], c.norm_eps)
    x = layer_norm(h, lp["ln2"], c.norm_eps) if pre else h
    h = h + linear(ACTIVATIONS[c.activation](linear(x, lp["fc1"])), lp["fc2"])
    if not pre:
        h = layer_norm(h, lp["ln2"], c.norm_eps)
    return h, kv


def final(params, c, h):
    if c.has_final_layer_norm:
        h = layer_norm(h, params["final_ln"], c.norm_eps)
    if c.word_embed_proj_dim:
        h = linear(h, params["project_out"])
    return h
