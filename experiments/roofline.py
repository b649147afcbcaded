"""Decode-step roofline on this machine, and where an engine step's time goes.

    python experiments/roofline.py                      # GPT-2-124M-shaped, batches 1..128, context 128
    python experiments/roofline.py --batches 1,8,32 --context 64 --profile-prompts 32

1. Measures, in this run, the machine's float32 matmul rate (jitted square matmuls) and its
   memory read bandwidth (the faster of a jitted sum over a large array and the native
   kernels' prefetching reader).
2. Times the engine's jitted decode step (``ModelRunner.run_batch``: every sequence one new
   token, ``--context`` tokens of KV each) for each batch size, and reports the floor
   ``max(FLOPs / rate, bytes / bandwidth)`` and the fraction of it achieved (floor / measured).
   FLOPs: 2 x multiply-adds of the projections, MLP and LM head per token, plus attention
   (QK^T and PV over the context). Bytes: every weight once per step, plus each sequence's
   K and V, plus the logits written.
   The step runs with the native CPU kernels (``paged_jax.native``: paged decode attention,
   and the matmuls against panel-packed weights) where they are built. Beside it, in the same
   run: "matmuls alone", the same linear layers multiplied one after another in one jitted
   function (no attention, norms or sampling) at the same batch, which the step cannot beat;
   and both again with XLA alone (``PAGED_JAX_NATIVE=0``: plain weights, XLA's CPU matmuls,
   decode attention in jnp).
3. Runs ``--profile-prompts`` requests through the engine (all at once, fixed lengths) and
   splits its step time into scheduler + block manager, batch preparation, device step,
   sampling, and the engine's processing (detokenization shown on its own).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench_common import gpt2_124m_model

import jax
import jax.numpy as jnp
import numpy as np


def _best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def machine_limits(repeats: int = 15) -> tuple[float, float]:
    """(float32 matmul FLOP/s, memory read bytes/s), the best of ``repeats``; the rate is the
    best of a 1024- and a 2048-square matmul (the smaller often runs closer to the peak), with
    XLA's matmul and, where built, the native one; the bandwidth the better of a jitted
    ``jnp.sum`` and the native kernels' reader (``paged_jax.native.read_sum``) over 256 MiB.
    So no kernel of the step can out-run the limits it is measured against."""
    from paged_jax import native

    mms = [(jax.jit(lambda x, y: x @ y), lambda w: w)]
    if native.available():
        mms.append((jax.jit(native.linear), native.pack_weight))
    rate = 0.0
    for n in (1024, 2048):
        a = jnp.ones((n, n), jnp.float32)
        for mm, prep in mms:
            b = prep(jnp.ones((n, n), jnp.float32))
            rate = max(rate, 2 * n ** 3 / _best(lambda: mm(a, b), repeats))
    big = jnp.ones((256 << 20) // 4, jnp.float32)  # 256 MiB, far beyond the caches
    readers = [jax.jit(jnp.sum)] + ([jax.jit(native.read_sum)] if native.available() else [])
    bw = max(big.nbytes / _best(lambda: red(big), repeats) for red in readers)
    return rate, bw


def step_cost(cfg, num_params: int, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of ``batch`` sequences at ``context`` tokens."""
    H, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    per_token = L * (H * (H + 2 * kv_dim) + H * H + 2 * H * F) + H * V  # multiply-adds of the matmuls
    attn = L * 2 * context * cfg.num_heads * cfg.head_dim  # QK^T and PV
    flops = 2.0 * batch * (per_token + attn)
    dt = jnp.dtype(cfg.dtype).itemsize
    nbytes = num_params * dt + batch * context * cfg.kv_bytes_per_token + batch * V * 4
    return flops, nbytes


def matmuls_alone(params, hidden: int, batch: int):
    """A jitted function running every linear layer of the model (each layer's in the order the
    layer uses them, then the LM head) once on ``batch`` rows, each taking the previous one's
    output (cut or tiled to its width): one chain, as in the model, so no two run at once.
    Through the weight objects' own matmuls, so packed params (``paged_jax.weights.to_panels``)
    take the native matmul and plain ones XLA's."""
    import dataclasses

    from paged_jax.weights import is_weight

    layers = [[dataclasses.replace(p, b=None) for p in lp.values() if is_weight(p) and not hasattr(p, "lookup")]  # matmuls only
              for lp in params["layers"]]
    head = {k: params[k] for k in ("lm_head",) if k in params} or {"embed": params["embed"]}

    def fit(y, width):
        return y[:, :width] if y.shape[1] >= width else jnp.tile(y, (1, -(-width // y.shape[1])))[:, :width]

    def f(layers, head, h):
        y = h
        for ps in layers:
            for p in ps:
                y = p(fit(y, p.in_features))
        y = fit(y, hidden)  # the LM head's matmul (no soft-cap: matmuls only)
        return head["lm_head"](y) if "lm_head" in head else head["embed"].logits(y)

    fn = jax.jit(f)
    x = jnp.ones((batch, hidden), jax.tree_util.tree_leaves(head)[0].dtype)
    return lambda: fn(layers, head, x)


class _NativeOff:
    """``PAGED_JAX_NATIVE=0`` inside: runners built here choose the jnp attention, and steps traced
    here use XLA's matmuls (on plain weights) and jnp decode attention."""

    def __enter__(self):
        self.old = os.environ.get("PAGED_JAX_NATIVE")
        os.environ["PAGED_JAX_NATIVE"] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            del os.environ["PAGED_JAX_NATIVE"]
        else:
            os.environ["PAGED_JAX_NATIVE"] = self.old


def decode_roofline(model: str, batches: list[int], context: int, block_size: int, repeats: int,
                    compare_xla: bool = True) -> list[dict]:
    from paged_jax import native
    from paged_jax.executor.batch import SeqChunk, prepare_batch
    from paged_jax.executor.model_runner import ModelRunner
    from paged_jax.executor.loading import load_for_serving

    from paged_jax.weights import prepare

    cfg, params, _ = load_for_serving(model, "float32", 1, native_kernels=False)  # plain weights: XLA's matmuls
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    per_seq = -(-context // block_size)
    runner = ModelRunner(cfg, prepare(params, "cpu"), block_size, max(batches) * per_seq + 1, 0)
    xla_runner = None
    if compare_xla:
        with _NativeOff():
            xla_runner = ModelRunner(cfg, params, block_size, max(batches) * per_seq + 1, 0)
    rate, bw = machine_limits()  # measured again after the batches: the floors use the best of both
    on = native.available()
    print(f"machine (first measurement): float32 matmul {rate / 1e9:.0f} GFLOP/s, memory read {bw / 1e9:.1f} GB/s; "
          f"native CPU kernels (decode attention, matmuls): {'on' if on else 'off: ' + str(native.status())}; "
          f"model {num_params / 1e6:.1f} M parameters ({cfg.family}, {cfg.dtype}); context {context} tokens")
    rows = []
    for b in batches:
        chunks = [SeqChunk([7], context - 1, list(range(1 + s * per_seq, 1 + (s + 1) * per_seq))) for s in range(b)]
        batch = prepare_batch(chunks, block_size)
        t = _best(lambda: runner.run_batch(batch), repeats)
        t_mm = _best(matmuls_alone(runner.params, cfg.hidden_size, b), repeats)
        t_xla = t_xla_mm = None
        if xla_runner is not None:
            with _NativeOff():
                jax.block_until_ready(xla_runner.run_batch(batch))  # traced without the native kernels
                t_xla = _best(lambda: xla_runner.run_batch(batch), repeats)
                t_xla_mm = _best(matmuls_alone(xla_runner.params, cfg.hidden_size, b), repeats)
        rows.append({"batch": b, "step_ms": 1e3 * t, "matmuls_ms": 1e3 * t_mm,
                     "xla_step_ms": t_xla and 1e3 * t_xla, "xla_matmuls_ms": t_xla_mm and 1e3 * t_xla_mm})
    rate2, bw2 = machine_limits()
    rate, bw = max(rate, rate2), max(bw, bw2)
    print(f"machine: float32 matmul {rate / 1e9:.0f} GFLOP/s, memory read {bw / 1e9:.1f} GB/s (the better of "
          f"two measurements, before and after the steps)")
    for r in rows:
        b = r["batch"]
        flops, nbytes = step_cost(cfg, num_params, b, context)
        floor = max(flops / rate, nbytes / bw)
        t = r["step_ms"] / 1e3
        r.update({"floor_ms": 1e3 * floor, "fraction": floor / t, "matmuls_fraction": floor * 1e3 / r["matmuls_ms"],
                  "xla_fraction": r["xla_step_ms"] and floor * 1e3 / r["xla_step_ms"],
                  "xla_matmuls_fraction": r["xla_matmuls_ms"] and floor * 1e3 / r["xla_matmuls_ms"],
                  "bound": "compute" if flops / rate > nbytes / bw else "memory",
                  "gflops": flops / t / 1e9, "gbytes_per_s": nbytes / t / 1e9, "tokens_per_s": b / t})
        print(f"batch {b:4d}: step {r['step_ms']:8.2f} ms, floor {r['floor_ms']:8.2f} ms ({r['bound']}-bound), "
              f"achieved {100 * r['fraction']:5.1f}% of the floor; {r['gflops']:6.1f} GFLOP/s, "
              f"{r['gbytes_per_s']:5.1f} GB/s, {r['tokens_per_s']:7.1f} tokens/s; matmuls alone {r['matmuls_ms']:7.2f} ms "
              f"({100 * r['matmuls_fraction']:5.1f}%)"
              + (f"; XLA only (no native kernels): step {r['xla_step_ms']:7.2f} ms ({100 * r['xla_fraction']:5.1f}%), "
                 f"matmuls alone {r['xla_matmuls_ms']:7.2f} ms ({100 * r['xla_matmuls_fraction']:5.1f}%)"
                 if r["xla_step_ms"] else ""), flush=True)
    return rows


def engine_profile(model: str, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int) -> dict:
    from paged_jax import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=input_len + output_len, seed=0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.llm_engine.warm_up(params)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(num_prompts)]
    before = llm.llm_engine.get_stats()
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.llm_engine.get_stats()
    t = {k: after["timings"][k] - before["timings"][k] for k in after["timings"]}
    parts = {"scheduler + block manager": t["schedule"], "batch preparation": t["prepare"] + t["cache_ops"],
             "device step": t["device"], "sampling": t["sample"], "detokenization": t["detokenize"],
             "other engine processing": t["process"] - t["detokenize"]}
    total = sum(parts.values())
    print(f"\nengine profile: {num_prompts} requests x ({input_len} in, {output_len} out), "
          f"{after['num_steps'] - before['num_steps']} steps, {wall:.1f} s wall, "
          f"{after['num_compilations'] - before['num_compilations']} compilations after warm-up")
    for k, v in parts.items():
        print(f"  {k:<28} {1e3 * v:9.1f} ms  {100 * v / total:5.1f}%")
    overhead = (t["schedule"] + t["prepare"]) / total
    print(f"  scheduler + block manager + batch preparation: {100 * overhead:.1f}% of step time")
    return {"parts_s": parts, "overhead_fraction": overhead, "wall_s": wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: a GPT-2-124M-shaped random model)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--context", type=int, default=128, help="tokens of KV per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile-prompts", type=int, default=64, help="0: no engine profile")
    ap.add_argument("--profile-lens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 96],
                    help="input,output tokens of the profiled requests")
    ap.add_argument("--no-compare-xla", action="store_true",
                    help="skip timing the step and the matmuls with XLA alone (no native kernels) beside")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    if a.context < 1 or min(a.batches) < 1:
        raise SystemExit(f"--context and --batches must be >= 1, got {a.context}, {a.batches}")
    model = a.model or gpt2_124m_model()
    out = {"roofline": decode_roofline(model, a.batches, a.context, a.block_size, a.repeats,
                                       compare_xla=not a.no_compare_xla)}
    if a.profile_prompts:
        out["profile"] = engine_profile(model, a.profile_prompts, *a.profile_lens, max_num_seqs=a.profile_prompts)
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
