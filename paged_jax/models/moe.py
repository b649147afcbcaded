"""Mixture-of-experts layers, one implementation for every family (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router scores the experts of each token (softmax or sigmoid of a linear map), keeps the top k
(their scores renormalised to sum to one, or not, as the config says), and the token's output is the
score-weighted sum of those experts' SwiGLU MLPs, plus a shared expert (behind its own sigmoid gate)
where the family has one. Experts are stacked weights: ``gate_up`` ``[E, hidden, 2 * I]`` (gate and up
side by side, one matmul) and ``down`` ``[E, I, hidden]``.

How the experts run: the step's (token, expert) pairs are sorted by expert, and every expert multiplies
a window of the sorted rows that starts at its own segment, all experts in one batched matmul against
the stacked weights (``[E, C, H] @ [E, H, 2I]``). The window size C is the step's largest segment rounded
up a ladder of sizes (1, 2, 4, 8, 16, 24, 32, 48, ...), chosen at run time by ``lax.switch``; rows of a
window past its expert's segment are masked out, and the results are added back to their tokens. So the
work is E x C rows where the dense all-experts formulation does E x T, and no weights are copied. A step
of a few tokens (at most E / 2k: decoding one or two sequences) instead runs only the experts chosen,
each behind a ``lax.cond``, so the others' weights are not even read.

Measured side by side on this project's CPU (``experiments/bench_moe.py``: 8 experts, top-2, hidden
512, expert width 1024, float32, weights passed as arguments as the engine passes params; 2 shared,
noisy cores, so runs differ by tens of percent), against the dense all-experts batched matmul this ran
1.1-1.7x as fast at 32 tokens, about 2.1x at 128, 1.3-2.3x at one token, and about even at 4-8 tokens
(where every expert is chosen and all weights are read either way). The alternatives lost:
``jax.lax.ragged_dot`` ran 6-20x *slower* than this (on the CPU XLA lowers it to one dense matmul over
all groups with masked inputs, after copying the whole weight into a new layout), and a loop over the
experts, each on its own window, ran about as slow as the dense matmul (each iteration copied its
expert's weight slice). On a GPU, where ``ragged_dot`` is a grouped GEMM and each ``lax.switch`` or
``lax.cond`` reads its branch index back to the host, the balance may differ: measure there.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama
from paged_jax.models.layers import linear, rms_norm

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


def window_sizes(num_rows: int) -> list[int]:
    """The ladder of window sizes the largest segment is rounded up to: 1, 2, 4, 8, then two sizes per
    doubling (16, 24, 32, 48, 64, 96, ...), and last ``num_rows`` (the most one expert can get: each
    token picks it at most once)."""
    sizes, s = [], 1
    while s < min(num_rows, 8):
        sizes.append(s)
        s *= 2
    s = 8
    while s < num_rows:
        sizes.append(s)
        s = s * 3 // 2 if (s & (s - 1)) == 0 else s * 4 // 3  # a power of two, then 1.5 times one
    return sizes + [num_rows]


def grouped_experts(x, weights, experts, gate_up, down, act=jax.nn.silu, real=None):
    """Each token's weighted sum over its chosen experts' SwiGLU MLPs, by sort-and-segment.

    x ``[T, H]``; weights, experts ``[T, k]``; gate_up ``[E, H, 2I]``; down ``[E, I, H]``; ``real``
    ``[T]`` bool: the step's real tokens (the others, the batch's padding, go to no expert and get 0)."""
    T, k = experts.shape
    E = gate_up.shape[0]
    if real is not None:  # padding sorts after every expert's segment and counts for none
        experts = jnp.where(real[:, None], experts, E)

    def mlp(xs, gate_up, down, weight):  # [..., rows, H] -> [..., rows, H] float32, times each row's weight
        gate, up = jnp.split(jnp.matmul(xs, gate_up), 2, axis=-1)
        return jnp.matmul(act(gate) * up, down).astype(jnp.float32) * weight[..., None]

    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token = (order // k).astype(jnp.int32)
    counts = jnp.bincount(flat, length=E + 1)[:E]
    starts = jnp.cumsum(counts) - counts
    sizes = window_sizes(T)
    pad = sizes[-1]  # a window starting at the last segment may run past the end: padding rows
    rows = jnp.concatenate([x[token], jnp.zeros((pad, x.shape[1]), x.dtype)])
    row_weight = jnp.concatenate([weights.reshape(-1)[order], jnp.zeros((pad,), weights.dtype)])
    row_token = jnp.concatenate([token, jnp.zeros((pad,), jnp.int32)])

    if 2 * T * k <= E:  # a few tokens (decoding a few sequences): only the experts they chose read their weights
        def expert(e, out):
            def run(out):
                y = mlp(rows[starts[e] + jnp.arange(T)], gate_up[e], down[e], row_weight[starts[e] + jnp.arange(T)])
                mine = jnp.arange(T) < counts[e]
                return out.at[row_token[starts[e] + jnp.arange(T)]].add(jnp.where(mine[:, None], y, 0.0))
            return jax.lax.cond(counts[e] > 0, run, lambda out: out, out)

        out = jnp.zeros(x.shape, jnp.float32)
        for e in range(E):  # unrolled: a static slice of the weights, read only when the expert runs
            out = expert(e, out)
        return out.astype(x.dtype)

    def windows(size):
        def run():
            at = starts[:, None] + jnp.arange(size)[None, :]  # [E, size]: each expert's window of sorted rows
            y = mlp(rows[at], gate_up, down, row_weight[at])  # one batched matmul, no weight copies
            mine = jnp.arange(size)[None, :] < counts[:, None]  # rows past the segment: the next expert's
            y = jnp.where(mine[..., None], y, 0.0).reshape(-1, x.shape[1])
            return jnp.zeros(x.shape, jnp.float32).at[row_token[at].reshape(-1)].add(y)
        return run

    branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), jnp.max(counts))  # the smallest that holds all
    return jax.lax.switch(branch, [windows(s) for s in sizes]).astype(x.dtype)


def moe_mlp(p, cfg: MoEConfig, x, real=None):
    """The mixture's output for normed hidden states ``x`` ``[T, H]`` (``p``: :func:`moe_params`;
    ``real``: as :func:`grouped_experts` takes it)."""
    weights, experts = route(linear(x, p["router"]), cfg)
    y = grouped_experts(x, weights, experts, p["gate_up"], p["down"], real=real)
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
    x = rms_norm(h, lp["ln2"], c.norm_eps)
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


def _array_module(tensors):
    """numpy or jax.numpy, as ``get`` gave the tensors."""
    if not all(hasattr(t, "dtype") for t in tensors):
        # the sharded loader's abstract tensors (paged_jax.parallel.checkpoint) have no stacked form yet
        raise ModelLoadError("stacked expert weights load only unsharded (tensor_parallel_size 1, a Hugging "
                             "Face folder); experts split over devices are not supported yet")
    return np if isinstance(tensors[0], np.ndarray) else jnp


def moe_params(c, get, lin, names: ExpertNames):
    """``mlp(i, prefix)`` for :func:`paged_jax.models.llama.params_from_hf`: the mixture's params on a
    sparse layer, LLaMA's MLP on the others."""
    m = c.moe

    def mlp(i, p):
        if i not in m.sparse_layers:
            return llama.mlp_params(lin, p + "mlp.")
        q = p + names.block
        gate, up, down = names.expert
        expert = [f"{q}experts.{e}." for e in range(m.num_experts)]
        # checkpoint Linear weights are [out, in]; the stacks are [E, in, out], gate and up side by side
        gates = [get(x + f"{gate}.weight").T for x in expert]
        ups = [get(x + f"{up}.weight").T for x in expert]
        xp = _array_module(gates)
        out = {"router": lin(q + "gate", None), "gate_up": xp.concatenate([xp.stack(gates), xp.stack(ups)], axis=-1),
               "down": xp.stack([get(x + f"{down}.weight").T for x in expert])}
        if m.shared_intermediate_size:
            out["shared"] = llama.mlp_params(lin, q + names.shared + ".")
        if m.shared_expert_gate:
            out["shared_gate"] = lin(q + names.shared_gate, None)
        return {"moe": out}

    return mlp

