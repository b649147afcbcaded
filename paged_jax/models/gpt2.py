"""GPT-2: learned positions, Conv1D weights (already [in, out]), gelu_new."""

from __future__ import annotations

import jax.numpy as jnp

from paged_jax.errors import ModelLoadError
from paged_jax.models.config import ModelConfig, eos_tuple, require
from paged_jax.models.family import ModelFamily
from paged_jax.models.layers import ACTIVATIONS, layer_norm, linear, split_heads
from paged_jax.weights import DenseEmbedding, DenseLinear


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    hidden = int(cfg.get("n_embd", cfg.get("hidden_size", 768)))
    heads = int(cfg.get("n_head", cfg.get("num_attention_heads", 12)))
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"{where}: activation_function {act!r} is not supported for GPT-2")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            raise ModelLoadError(f"{where}: GPT-2 option {flag}=True is not supported")
    if cfg.get("scale_attn_weights", True) is False:
        raise ModelLoadError(f"{where}: GPT-2 option scale_attn_weights=False is not supported")
    inner = cfg.get("n_inner")
    return ModelConfig(
        family="gpt2", vocab_size=int(require(cfg, "vocab_size", where)), hidden_size=hidden,
        num_layers=int(cfg.get("n_layer", cfg.get("num_hidden_layers", 12))), num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=int(inner) if inner else 4 * hidden,
        max_position_embeddings=int(cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), activation=act,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), dtype=dt,
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos_tuple(cfg.get("eos_token_id")))


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
    def conv1d(prefix, parallel):  # Conv1D stores [in, out]: no transpose
        return DenseLinear(get(prefix + ".weight"), get(prefix + ".bias"), parallel)

    def ln(prefix):
        return {"w": get(prefix + ".weight"), "b": get(prefix + ".bias")}

    layers = []
    for i in range(c.num_layers):
        p = f"transformer.h.{i}."
        # the fused c_attn (Q|K|V concatenated) stays replicated: its column shards would be Q only
        layers.append({"ln1": ln(p + "ln_1"), "ln2": ln(p + "ln_2"), "qkv": conv1d(p + "attn.c_attn", None),
                       "o": conv1d(p + "attn.c_proj", "row"), "fc": conv1d(p + "mlp.c_fc", "column"),
                       "proj": conv1d(p + "mlp.c_proj", "row")})
    params = {"embed": DenseEmbedding(get("transformer.wte.weight"), tied=c.tie_word_embeddings), "pos": get("transformer.wpe.weight"),
              "final_ln": ln("transformer.ln_f"), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = DenseLinear(get("lm_head.weight").T, parallel="column")
    return params


def embed(params, c, input_ids, positions):
    return params["embed"].lookup(input_ids) + params["pos"][positions]


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


FAMILY = ModelFamily(
    name="gpt2", architectures=("GPT2LMHeadModel",), model_types=("gpt2",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=embed, layer=layer, final=final,
    tiny_config=dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=64, n_layer=2, n_head=4,
                     n_positions=1024, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     tie_word_embeddings=True),
    tiny_tokens=dict(bos="<|endoftext|>", eos="<|endoftext|>", unk="<unk>", pad=None, add_bos=False))
