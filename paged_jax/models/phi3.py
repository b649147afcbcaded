"""Phi-3 (mini, small, medium; 4k and 128k): LLaMA's layer with fused ``qkv_proj`` and ``gate_up_proj``
weights (split at load into LLaMA's Q / K / V and gate / up, so the layer and the tensor-parallel roles
are LLaMA's), RoPE with ``longrope`` scaling and ``partial_rotary_factor``, and an optional sliding window
on every layer."""

from __future__ import annotations

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama
from paged_jax.models.config import ModelConfig
from paged_jax.models.family import ModelFamily
from paged_jax.weights import DenseEmbedding, DenseLinear


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    return llama.config_from_hf(cfg, dt, where, family="phi3", sliding_window=window)


def hf_tensor_shapes(c) -> dict[str, tuple]:
    """LLaMA's tensors (no biases), with Q / K / V and gate / up each one fused tensor."""
    shapes = llama.hf_tensor_shapes(c, qkv_bias=False, o_bias=False)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            del shapes[p + name + ".weight"]
        shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, c.hidden_size)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
    return shapes


def params_from_hf(c, get, lin) -> dict:
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        qkv = get(p + "self_attn.qkv_proj.weight").T  # [hidden, q | k | v]
        gate_up = get(p + "mlp.gate_up_proj.weight").T  # [hidden, gate | up]
        layers.append({
            "ln1": get(p + "input_layernorm.weight"), "ln2": get(p + "post_attention_layernorm.weight"),
            "q": DenseLinear(qkv[:, :q], parallel="column"), "k": DenseLinear(qkv[:, q:q + kv], parallel="kv"),
            "v": DenseLinear(qkv[:, q + kv:], parallel="kv"), "o": lin(p + "self_attn.o_proj", "row"),
            "gate": DenseLinear(gate_up[:, :inter], parallel="column"),
            "up": DenseLinear(gate_up[:, inter:], parallel="column"), "down": lin(p + "mlp.down_proj", "row"),
        })
    params = {"embed": DenseEmbedding(get("model.embed_tokens.weight"), tied=c.tie_word_embeddings),
              "norm": get("model.norm.weight"), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = lin("lm_head", "column")
    return params


FAMILY = ModelFamily(
    name="phi3", architectures=("Phi3ForCausalLM",), model_types=("phi3",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=llama.embed, layer=llama.layer, final=llama.final,
    tiny_config=dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=64, intermediate_size=176,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     original_max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=False, hidden_act="silu", sliding_window=None,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [1.0 + 0.5 * i for i in range(8)]}),
    tiny_tokens=dict(bos="<s>", eos="<|endoftext|>", unk="<unk>", pad="<|endoftext|>", add_bos=True))
