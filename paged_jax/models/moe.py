"""Mixture-of-experts layers, one implementation for every family (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router scores the experts of each token (softmax or sigmoid of a linear map), keeps the top k
(their scores renormalised to sum to one, or not, as the config says), and the token's output is the
score-weighted sum of those experts' SwiGLU MLPs, plus a shared expert (behind its own sigmoid gate)
where the family has one.

The experts are stacked weights (:class:`~paged_jax.weights.experts.ExpertStack`: ``gate``, ``up``
``[E, hidden, I]``, ``down`` ``[E, I, hidden]``), each expert read from the checkpoint as any linear
layer is (float, or quantized as the checkpoint stores it), and run by
:mod:`paged_jax.models.moe_experts`: sorted by expert on one device, or split over devices under
tensor parallelism (expert parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama
from paged_jax.models.layers import linear, rms_norm
from paged_jax.models.moe_experts import expert_mesh, grouped_experts, split_experts
from paged_jax.weights.experts import stack_experts

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a :class:`~paged_jax.models.config.ModelConfig` (its ``moe``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the kept top-k scores divided by their sum (Mixtral; Qwen's norm_topk_prob)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the mixture (the others: a dense MLP)
    scoring: str = "softmax"
    shared_intermediate_size: int = 0  # a shared expert every token goes through (0: none)
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w) (Qwen2-MoE)
    # gpt-oss's clamped SwiGLU (None: plain SwiGLU): gate clamped above at the limit, up to +-limit,
    # output (up + 1) * gate * sigmoid(alpha * gate); its experts' ``gate`` stack is the fused gate_up
    # projection (gate and up interleaved by column) and there is no ``up`` stack
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.0


def moe_config(cfg: dict, where: str, num_layers: int, **fields) -> MoEConfig:
    """A checked MoEConfig from config.json's ``num_experts_per_tok`` and the fields the family read."""
    config = MoEConfig(top_k=int(cfg.get("num_experts_per_tok", 2)), **fields)
    if config.num_experts < 1 or not 1 <= config.top_k <= config.num_experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok must be in 1..{config.num_experts} (the number of "
                             f"experts), got {config.top_k}")
    if config.scoring not in SCORINGS:
        raise ModelLoadError(f"{where}: router scoring {config.scoring!r} is not supported; supported: {list(SCORINGS)}")
    bad = [i for i in config.sparse_layers if not 0 <= i < num_layers]
    if bad:
        raise ModelLoadError(f"{where}: mixture-of-experts layers {bad} do not exist (the model has {num_layers})")
    return config


# --- routing and the experts -------------------------------------------------------------------


def route(logits, cfg: MoEConfig):
    """Router logits ``[T, E]`` -> (float32 weights ``[T, k]``, expert ids ``[T, k]``)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if cfg.scoring == "softmax" else jax.nn.sigmoid(logits)
    weights, experts = jax.lax.top_k(scores, cfg.top_k)
    if cfg.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def clamped_swiglu(limit: float, alpha: float):
    """gpt-oss's gating, as transformers' ``GptOssExperts`` computes it: the fused projection's
    ``[..., 2 I]`` output (gate in the even columns, up in the odd) -> ``[..., I]``."""
    def glu(gate_up):
        gate, up = jnp.minimum(gate_up[..., 0::2], limit), gate_up[..., 1::2]
        return (jnp.clip(up, -limit, limit) + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return glu


def moe_mlp(p, cfg: MoEConfig, x, real=None):
    """The mixture's output for normed hidden states ``x`` ``[T, H]`` (``p``: :func:`moe_params`;
    ``real``: as :func:`~paged_jax.models.moe_experts.grouped_experts` takes it)."""
    weights, experts = route(linear(x, p["router"]), cfg)
    stacks = {n: p[n] for n in ("gate", "up", "down") if n in p}
    glu = None if cfg.swiglu_limit is None else clamped_swiglu(cfg.swiglu_limit, cfg.swiglu_alpha)
    mesh = expert_mesh(stacks)
    if mesh is None:
        y = grouped_experts(x, weights, experts, stacks, real=real, glu=glu)
    else:
        y = split_experts(mesh, x, weights, experts, stacks, real=real, glu=glu)
    y = y.astype(x.dtype)
    if "shared" in p:
        shared = llama.mlp(p["shared"], x)
        if "shared_gate" in p:
            shared = jax.nn.sigmoid(linear(x, p["shared_gate"])) * shared
        y = y + shared
    return y


def real_tokens(attn):
    """The step's real tokens (``[T]`` bool), from the step's metadata ``attn.meta`` (see
    :class:`paged_jax.models.LayerAttention`; padded tokens belong to sequence row S); None without it."""
    meta = getattr(attn, "meta", None)
    return None if meta is None else meta.token_seq < meta.block_tables.shape[0]


def layer(lp, c, h, positions, kv, attn):
    """LLaMA's attention, then the mixture (or, on a layer without one, LLaMA's MLP)."""
    h, kv = llama.attention(lp, c, h, positions, kv, attn)
    x = rms_norm(h, lp["ln2"], c.norm_eps, c.native_norm)
    # Padding tokens all route alike: left in, they would lengthen one expert's segment, so every window
    return h + (moe_mlp(lp["moe"], c.moe, x, real_tokens(attn)) if "moe" in lp else llama.mlp(lp, x)), kv


# --- checkpoint tensors ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoint keeps a mixture, under ``model.layers.{i}.``: ``block`` the
    module (``mlp.``), ``expert`` its experts' names ``(gate, up, down)``, and the shared expert."""

    block: str = "mlp."
    expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = "shared_expert"
    shared_gate: str = "shared_expert_gate"


def hf_tensor_shapes(c, shapes: dict, names: ExpertNames) -> dict[str, tuple]:
    """``shapes`` (a dense layer's tensors, LLaMA's) with each sparse layer's MLP replaced by the mixture."""
    m, H = c.moe, c.hidden_size
    for i in m.sparse_layers:
        p = f"model.layers.{i}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            shapes.pop(p + f"mlp.{name}.weight")
        q = p + names.block
        shapes[q + "gate.weight"] = (m.num_experts, H)
        gate, up, down = names.expert
        for e in range(m.num_experts):
            shapes[q + f"experts.{e}.{gate}.weight"] = (m.intermediate_size, H)
            shapes[q + f"experts.{e}.{up}.weight"] = (m.intermediate_size, H)
            shapes[q + f"experts.{e}.{down}.weight"] = (H, m.intermediate_size)
        if m.shared_intermediate_size:
            S = m.shared_intermediate_size
            for name, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
                shapes[q + f"{names.shared}.{name}.weight"] = shape
        if m.shared_expert_gate:
            shapes[q + f"{names.shared_gate}.weight"] = (1, H)
    return shapes


def moe_params(c, get, lin, names: ExpertNames):
    """``mlp(i, prefix)`` for :func:`paged_jax.models.llama.params_from_hf`: the mixture's params on a
    sparse layer, LLaMA's MLP on the others."""
    m = c.moe

    def mlp(i, p):
        if i not in m.sparse_layers:
            return llama.mlp_params(lin, p + "mlp.")
        q = p + names.block
        out = {"router": lin(q + "gate", None)}
        for key, name in zip(("gate", "up", "down"), names.expert):
            # each expert as any linear layer: float, or quantized as the checkpoint stores it
            linears = [lin(f"{q}experts.{e}.{name}", None) for e in range(m.num_experts)]
            try:
                out[key] = stack_experts(linears)
            except ValueError as e:
                raise ModelLoadError(f"{q}experts.*.{name}: {e}") from None
        if m.shared_intermediate_size:
            out["shared"] = llama.mlp_params(lin, q + names.shared + ".")
        if m.shared_expert_gate:
            out["shared_gate"] = lin(q + names.shared_gate, None)
        return {"moe": out}

    return mlp

