"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b) in bfloat16, float16 or float32 weights.

LLaMA's layer (RMSNorms, RoPE, grouped-query attention, here with biases on Q/K/V/O) with:

- attention sinks: a learned logit per query head that joins every softmax's denominator
  (``self_attn.sinks``; :class:`~paged_jax.attention.AttentionSpec` ``sinks``, honoured by the
  reference and native backends, refused at start by the Pallas kernels);
- a sliding window (``sliding_window``, 128) on alternating layers (``layer_types``: even layers
  windowed), so the model gets one layer group per kind (:mod:`paged_jax.memory.layer_groups`);
- YaRN RoPE (``rope_parameters``, factor 32 over 4,096 positions, ``truncate`` false);
- a mixture of experts on every layer (:mod:`paged_jax.models.moe`): a router with a bias, top-k of
  its logits with a softmax over the k kept (the same weights as a softmax over all, renormalised),
  and experts stored as fused 3-D tensors, ``gate_up_proj`` ``[E, hidden, 2 I]`` with gate and up
  interleaved (even and odd columns) and ``down_proj`` ``[E, I, hidden]``, each with a bias, gated by
  the clamped SwiGLU (:func:`~paged_jax.models.moe.clamped_swiglu`, ``swiglu_limit`` and
  ``swiglu_alpha``).

The released checkpoints store the experts in MXFP4 (``quantization_config.quant_method: mxfp4``):
not supported here (refused at load); their bfloat16 conversions load.
"""

from __future__ import annotations

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama, moe
from paged_jax.models.config import ModelConfig, check_layer_types, require
from paged_jax.models.family import ModelFamily
from paged_jax.models.layers import rms_norm
from paged_jax.weights import DenseLinear
from paged_jax.weights.experts import ExpertStack

# transformers' GptOssConfig defaults, for config.json files that leave them out
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096, rope_theta=150000.0)


def config_from_hf(cfg: dict, dt: str, where: str) -> ModelConfig:
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method is not None:
        raise ModelLoadError(f"{where}: gpt-oss with quantization_config quant_method {method!r} is not supported "
                             "(its MXFP4 experts are not read here); supported: float weights (bfloat16, float16, "
                             "float32), e.g. a bfloat16 conversion of the checkpoint")
    layers = int(require(cfg, "num_hidden_layers", where))
    layer_types = check_layer_types(cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)], layers, where)
    window = cfg.get("sliding_window", 128)
    if "sliding_attention" in layer_types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg = dict(cfg, rope_parameters=dict(DEFAULT_ROPE, rope_theta=cfg.get("rope_theta", 150000.0)))
    cfg = dict(cfg, attention_bias=cfg.get("attention_bias", True), rms_norm_eps=cfg.get("rms_norm_eps", 1e-5))
    experts = moe.moe_config(cfg, where, layers, num_experts=int(require(cfg, "num_local_experts", where)),
                             intermediate_size=int(require(cfg, "intermediate_size", where)), renormalize=True,
                             sparse_layers=tuple(range(layers)),
                             swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                             swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    return llama.config_from_hf(cfg, dt, where, family="gpt_oss", sliding_window=window, layer_types=layer_types,
                                moe=experts, attention_sinks=True)


def hf_tensor_shapes(c) -> dict[str, tuple]:
    shapes = {n: s for n, s in llama.hf_tensor_shapes(c).items() if ".mlp." not in n}
    E, H, I = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.sinks"] = (c.num_heads,)
        shapes[p + "mlp.router.weight"] = (E, H)
        shapes[p + "mlp.router.bias"] = (E,)
        shapes[p + "mlp.experts.gate_up_proj"] = (E, H, 2 * I)
        shapes[p + "mlp.experts.gate_up_proj_bias"] = (E, 2 * I)
        shapes[p + "mlp.experts.down_proj"] = (E, I, H)
        shapes[p + "mlp.experts.down_proj_bias"] = (E, H)
    return shapes


def params_from_hf(c, get, lin) -> dict:
    def sinks_and_experts(i, p):  # what a gpt-oss layer has beyond LLaMA's attention
        q = p + "mlp.experts."
        # Stored [E, in, out] (transformers multiplies x @ w), as an ExpertStack holds them. gate_up stays
        # fused (one matmul; its interleaved columns are split by moe.clamped_swiglu), so that it loads
        # as it is stored, also straight into each device's experts under tensor parallelism.
        stack = {"gate": ExpertStack(DenseLinear(get(q + "gate_up_proj"), get(q + "gate_up_proj_bias"))),
                 "down": ExpertStack(DenseLinear(get(q + "down_proj"), get(q + "down_proj_bias")))}
        return {"sinks": get(p + "self_attn.sinks"), "moe": {"router": lin(p + "mlp.router", None), **stack}}

    return llama.params_from_hf(c, get, lin, mlp=sinks_and_experts)


def layer(lp, c, h, positions, kv, attn):
    def with_sinks(q, k, v, kv):
        return attn(q, k, v, kv, sinks=lp["sinks"].astype("float32"))

    h, kv = llama.attention(lp, c, h, positions, kv, with_sinks)
    x = rms_norm(h, lp["ln2"], c.norm_eps, c.native_norm)
    return h + moe.moe_mlp(lp["moe"], c.moe, x, moe.real_tokens(attn)), kv


FAMILY = ModelFamily(
    name="gpt_oss", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes, params_from_hf=params_from_hf,
    embed=llama.embed, layer=layer, final=llama.final,
    # a window of 8 on layer 0 (layer 1 sees everything), so that short prompts already cross it; YaRN over 64
    # positions
    tiny_config=dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=64,
                     intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
                     rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False, hidden_act="silu",
                     swiglu_alpha=1.702, swiglu_limit=7.0,
                     rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False, original_max_position_embeddings=64,
                                          rope_theta=150000.0)),
    tiny_tokens=dict(bos="<|startoftext|>", eos="<|return|>", unk="<unk>", pad=None, add_bos=False))
