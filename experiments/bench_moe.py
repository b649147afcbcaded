"""The mixture-of-experts step four ways, side by side in one run, and the engine's tokens/s on an MoE
model against a dense model of the same active parameters.

    python experiments/bench_moe.py [--experts 8] [--top-k 2] [--hidden 512] [--expert-width 1024]
                                    [--batches 1 8 32 128] [--repeats 7] [--skip-engine]

1. The experts of one layer (router included), jitted, for each batch of tokens: the dense
   all-experts formulation (a batched matmul: every token through every expert, weighted by its router scores, zero for the
   experts it did not choose), ``jax.lax.ragged_dot`` over the tokens sorted by expert, and
   :func:`paged_jax.models.moe_experts.grouped_experts` two ways: on ``ExpertStack`` weights (its
   windows, XLA's batched matmul: "sort+segment") and on ``PanelExpertStack`` weights (the native
   grouped matmul, what the engine runs on a CPU with AVX-512 tiles; left out elsewhere); beside them a
   dense SwiGLU MLP ``top_k x expert-width`` wide (the same active parameters, XLA's matmul). Each time
   is the median of ``--repeats`` rounds that run the variants in turn; all but the last give the same
   output. "dense/grouped" is the issue's ratio: the dense all-experts step over the engine's.
2. ``LLM.generate`` (greedy, ``--batch`` prompts decoding together): a tiny random Mixtral of these
   shapes against a LLaMA with ``intermediate_size = top_k x expert-width``, same attention, layers
   and vocabulary: generated tokens per second of each, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_common  # noqa: F401  (puts this checkout on the path)
from paged_jax.models import moe, moe_experts
from paged_jax import native
from paged_jax.weights import DenseLinear, ExpertStack
from paged_jax.weights.panels import PanelExpertStack


def dense_all_experts(x, router, gate_up, down, cfg):
    weights, experts = moe.route(x @ router, cfg)
    combine = jnp.zeros((x.shape[0], cfg.num_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    # a batched matmul over the experts (an einsum "th,ehf->etf" ran 5x slower: XLA copied the weights)
    every = jnp.broadcast_to(x[None], (cfg.num_experts,) + x.shape)
    gate, up = jnp.split(jnp.matmul(every, gate_up), 2, axis=-1)
    y = jnp.matmul(jax.nn.silu(gate) * up, down)  # [E, T, H]
    return jnp.sum(y * combine.T[:, :, None], axis=0)


def ragged(x, router, gate_up, down, cfg):
    weights, experts = moe.route(x @ router, cfg)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // cfg.top_k
    counts = jnp.bincount(flat, length=cfg.num_experts)
    gate, up = jnp.split(jax.lax.ragged_dot(x[token], gate_up, counts), 2, axis=-1)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, counts) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def segmented(x, router, stacks, cfg):
    weights, experts = moe.route(x @ router, cfg)
    return moe_experts.grouped_experts(x, weights, experts, stacks)


def dense_active(x, gate_up, down):
    gate, up = jnp.split(x @ gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ down


def time_layer(a) -> None:
    E, k, H, I = a.experts, a.top_k, a.hidden, a.expert_width
    cfg = moe.MoEConfig(E, k, I, renormalize=True, sparse_layers=(0,))
    rng = np.random.default_rng(0)
    router = jnp.asarray(rng.standard_normal((H, E)), jnp.float32)
    gate_up = jnp.asarray(0.05 * rng.standard_normal((E, H, 2 * I)), jnp.float32)
    down = jnp.asarray(0.05 * rng.standard_normal((E, I, H)), jnp.float32)
    active_gate_up = jnp.asarray(0.05 * rng.standard_normal((H, 2 * k * I)), jnp.float32)
    active_down = jnp.asarray(0.05 * rng.standard_normal((k * I, H)), jnp.float32)
    # weights are arguments, as the params are in the engine's step (constants would be folded by XLA)
    args = (router, gate_up, down)
    # the engine's layout: gate, up and down each an ExpertStack
    stacks = {"gate": gate_up[..., :I], "up": gate_up[..., I:], "down": down}
    stacks = {n: ExpertStack(DenseLinear(w)) for n, w in stacks.items()}
    variants = {"dense all experts": lambda x, w: dense_all_experts(x, *w, cfg),
                "ragged_dot": lambda x, w: ragged(x, *w, cfg),
                "sort+segment": lambda x, w: segmented(x, *w, cfg),
                "native grouped": lambda x, w: segmented(x, *w, cfg),
                "dense MLP, same active": lambda x, w: dense_active(x, *w)}
    weights = {n: (active_gate_up, active_down) if n.startswith("dense MLP") else args for n in variants}
    weights["sort+segment"] = (router, stacks)
    if native.available() and native.packs_weights():  # what the engine runs on this CPU (PanelExpertStack)
        weights["native grouped"] = (router, {n: PanelExpertStack.pack(s) for n, s in stacks.items()})
    else:
        del variants["native grouped"], weights["native grouped"]
    print(f"one MoE layer: {E} experts, top-{k}, hidden {H}, expert width {I}, float32, "
          f"median ms of {a.repeats} rounds ({jax.devices()[0].device_kind})")
    best = "native grouped" if "native grouped" in variants else "sort+segment"  # the engine's
    print(f"{'tokens':>6} " + " ".join(f"{n:>22}" for n in variants) +
          f"   dense/segment  dense/grouped  ragged/segment  {'grouped/same-active':>19}   ({best!r} as grouped)")
    for T in a.batches:
        x = jnp.asarray(0.5 * rng.standard_normal((T, H)), jnp.float32)
        fns = {n: jax.jit(f) for n, f in variants.items()}
        outs = {n: np.asarray(f(x, weights[n])) for n, f in fns.items()}
        for n in fns:  # the same function
            if n.startswith("dense MLP") or n == "sort+segment":
                continue
            np.testing.assert_allclose(outs[n], outs["sort+segment"], rtol=2e-4, atol=2e-4)
        times = {n: [] for n in fns}
        for _ in range(a.repeats):
            for n, f in fns.items():
                t = time.perf_counter()
                for _ in range(5):
                    f(x, weights[n]).block_until_ready()
                times[n].append((time.perf_counter() - t) / 5 * 1e3)
        ms = {n: statistics.median(v) for n, v in times.items()}
        seg, dense = ms["sort+segment"], ms["dense all experts"]
        print(f"{T:>6} " + " ".join(f"{ms[n]:>22.3f}" for n in fns) +
              f"   {dense / seg:>13.2f}  {dense / ms[best]:>13.2f}  {ms['ragged_dot'] / seg:>14.2f}  "
              f"{ms[best] / ms['dense MLP, same active']:>19.2f}")


def engine_tokens_per_s(a) -> None:
    from paged_jax import LLM, SamplingParams
    from paged_jax.models.tiny import make_tiny_model

    common = dict(hidden_size=a.hidden, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "mixtral": make_tiny_model(f"{tmp}/mixtral", "mixtral", intermediate_size=a.expert_width,
                                       num_local_experts=a.experts, num_experts_per_tok=a.top_k, **common),
            "llama, same active": make_tiny_model(f"{tmp}/llama", "llama",
                                                  intermediate_size=a.top_k * a.expert_width, **common)}
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 500, size=16).tolist() for _ in range(a.batch)]
        params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
        rates = {}
        for name, path in models.items():
            llm = LLM(str(path), block_size=16, max_model_len=128, max_num_seqs=a.batch)
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # compiles
            t = time.perf_counter()
            out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            rates[name] = sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)
        print(f"\nLLM.generate, {a.batch} prompts x {a.output_len} new tokens (16-token prompts, 2 layers):")
        for name, r in rates.items():
            print(f"  {name:<20} {r:8.1f} tokens/s")
        print(f"  mixtral / llama of the same active parameters: {rates['mixtral'] / rates['llama, same active']:.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32, help="prompts decoding together in the engine run")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--skip-engine", action="store_true")
    a = ap.parse_args(argv)
    time_layer(a)
    if not a.skip_engine:
        engine_tokens_per_s(a)


if __name__ == "__main__":
    main()
