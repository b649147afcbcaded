"""OPT: learned positions (offset 2), pre- or post-LayerNorm, ReLU FFN, optional project_in/out."""

from __future__ import annotations

from paged_jax.errors import ModelLoadError
from paged_jax.models.config import ModelConfig, eos_tuple, require
from paged_jax.models.family import ModelFamily
from paged_jax.models.layers import ACTIVATIONS, layer_norm, linear, project, split_heads
from paged_jax.weights import DenseEmbedding

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    act = cfg.get("activation_function", "relu")
    if act not in ("relu", "gelu", "gelu_new"):
        raise ModelLoadError(f"{where}: activation_function {act!r} is not supported for OPT; supported: relu, gelu, gelu_new")
    if not cfg.get("layer_norm_elementwise_affine", True):
        raise ModelLoadError(f"{where}: layer_norm_elementwise_affine=False is not supported")
    proj = cfg.get("word_embed_proj_dim")
    before = bool(cfg.get("do_layer_norm_before", True))
    return ModelConfig(
        family="opt", vocab_size=int(require(cfg, "vocab_size", where)), hidden_size=hidden,
        num_layers=int(require(cfg, "num_hidden_layers", where)), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=int(require(cfg, "ffn_dim", where)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), norm_eps=1e-5,
        activation=act, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), dtype=dt,
        do_layer_norm_before=before,
        word_embed_proj_dim=int(proj) if proj is not None and int(proj) != hidden else None,
        enable_bias=bool(cfg.get("enable_bias", True)),
        has_final_layer_norm=before and not cfg.get("_remove_final_layer_norm", False),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos_tuple(cfg.get("eos_token_id")))


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
            "q": lin(p + "self_attn.q_proj", "column"), "k": lin(p + "self_attn.k_proj", "kv"),
            "v": lin(p + "self_attn.v_proj", "kv"), "o": lin(p + "self_attn.out_proj", "row"),
            "fc1": lin(p + "fc1", "column"), "fc2": lin(p + "fc2", "row"),
        })
    params = {"embed": DenseEmbedding(get(d + "embed_tokens.weight"), tied=c.tie_word_embeddings),
              "pos": get(d + "embed_positions.weight"), "layers": layers}
    if c.word_embed_proj_dim:
        params["project_in"] = lin(d + "project_in", None)
        params["project_out"] = lin(d + "project_out", None)
    if c.has_final_layer_norm:
        params["final_ln"] = _ln(get, d + "final_layer_norm")
    if not c.tie_word_embeddings:
        params["lm_head"] = lin("lm_head", "column")
    return params


def embed(params, c, input_ids, positions):
    h = params["embed"].lookup(input_ids)
    if c.word_embed_proj_dim:
        h = linear(h, params["project_in"])
    return h + params["pos"][positions + POSITION_OFFSET]


def layer(lp, c, h, positions, kv, attn):
    pre = c.do_layer_norm_before
    x = layer_norm(h, lp["ln1"], c.norm_eps) if pre else h
    q, k, v = project(x, lp, "q", "k", "v")
    q, k, v = (split_heads(t, n, c.head_dim) for t, n in ((q, c.num_heads), (k, c.num_kv_heads), (v, c.num_kv_heads)))
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


FAMILY = ModelFamily(
    name="opt", architectures=("OPTForCausalLM",), model_types=("opt",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=embed, layer=layer, final=final,
    tiny_config=dict(architectures=["OPTForCausalLM"], model_type="opt", hidden_size=64, ffn_dim=256,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2048,
                     do_layer_norm_before=True, word_embed_proj_dim=64, activation_function="relu",
                     enable_bias=True, tie_word_embeddings=True),
    tiny_tokens=dict(bos="</s>", eos="</s>", unk="<unk>", pad="<pad>", add_bos=True))
