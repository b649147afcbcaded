"""A latency target against the fixed token budget: streams decoding while a long prompt prefills.

    python experiments/bench_itl_target.py [--prompt-len 4000] [--streams 16] [--multiples 2 5 25]

The workload is ``bench_long_prompt.py --stutter``'s (issue 18), on the same GPT-2-shaped model
(512 wide, 8 layers, random float32): ``--streams`` greedy requests decode, then a ``--prompt-len``
prompt arrives and runs to its first token. One process, side by side:

- **no target**: the engine's default (chunked prefill, a 256-token budget per step);
- **target k x**: ``target_itl_ms`` = k times the decode step measured in the no-target run (the
  median step of the streams alone), for each k of ``--multiples``.

Every engine is warmed up first (``warm_up``: every step shape compiled, and with a target the
step-cost model calibrated).

Each configuration runs the scenario on one engine until a run compiles nothing (the first compiles
the shapes it reaches; a target's chunk sizes may reach new ones later), at most 4 times, and reports
the last run. Printed: the streams' longest and p99 gap during the long prefill over their
median gap before it, the same gaps over the target, the long prompt's time to first token over its
time alone (the prompt alone on the no-target engine, its default budget), the steps it took, the
cost model's median prediction error and its median prefill chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import bench_common  # noqa: F401  (puts this checkout on the path)
from bench_long_prompt import STUTTER_MODEL, stutter_alone, stutter_run


def run(a) -> list[dict]:
    import numpy as np

    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs
    from paged_jax.models.tiny import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, n_positions=a.prompt_len + 128, **STUTTER_MODEL))
        decode_ms = alone_s = None
        for k in [None, *a.multiples]:
            target = None if k is None else round(k * decode_ms, 2)
            engine = LLMEngine(EngineArgs(model=model, max_model_len=a.prompt_len + 128, target_itl_ms=target))
            engine.warm_up(progress=False)  # every step shape compiled first (a target reaches many); then calibrates
            rng = np.random.default_rng(0)
            vocab = engine.model_config.vocab_size
            runs, alone = [], []
            for rep in range(4):  # until a run compiles nothing (the first compiles the shapes it reaches)
                prompt = rng.integers(3, vocab, size=a.prompt_len).tolist()
                before = engine.runner.num_compilations
                runs.append(stutter_run(engine, a.streams, prompt, a.before_steps, a.after_steps, rng, f"r{rep}"))
                compiled = engine.runner.num_compilations - before
                if k is None:
                    alone.append(stutter_alone(engine, prompt, f"r{rep}"))
                    compiled = engine.runner.num_compilations - before
                if rep and not compiled:
                    break
            r = dict(multiple=k, target_ms=target, budget=engine.scheduler_config.max_num_batched_tokens, **runs[-1],
                     runs=rep + 1, compiled_in_reported_run=compiled)
            if k is None:
                decode_ms, alone_s = 1e3 * r["decode_step_s"], alone[-1]
            r["ttft_alone_s"] = alone_s
            cost = engine.get_stats()["step_cost"]
            if cost:
                r.update(prediction_error=cost["median_relative_error"], knee=cost["knee_tokens"],
                         median_chunk=(cost["prefill_chunk_tokens"] or {}).get("median"),
                         coefficients=cost["coefficients"])
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            del engine
    return rows


def report(rows: list[dict], a) -> str:
    decode_ms = 1e3 * rows[0]["decode_step_s"]
    lines = [f"{a.streams} streams decoding, a {a.prompt_len:,}-token prompt arrives (GPT-2-shaped: 512 wide, "
             f"8 layers; float32; CPU). Decode step alone: {decode_ms:.1f} ms.", "",
             "| mode | target (ms) | max gap / median before | p99 gap / median | max gap / target | p99 gap / target "
             "| TTFT (s) | TTFT / alone | prefill steps | mixed step (ms) | prediction error | median chunk "
             "| runs (compiles in the last) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        med = r["median_gap_before_s"]
        if r["target_ms"] is None:
            mode, tgt, vs = f"no target (budget {r['budget']})", "-", ("-", "-")
        else:
            t = r["target_ms"] / 1e3
            mode, tgt = f"target {r['multiple']:g}x decode step", f"{r['target_ms']:.1f}"
            vs = (f"{r['max_gap_during_s'] / t:.2f}", f"{r['p99_gap_during_s'] / t:.2f}")
        err = f"{100 * r['prediction_error']:.0f} %" if r.get("prediction_error") is not None else "-"
        chunk = f"{r['median_chunk']:.0f}" if r.get("median_chunk") is not None else "-"
        lines.append(f"| {mode} | {tgt} | {r['max_gap_during_s'] / med:.1f}x | {r['p99_gap_during_s'] / med:.1f}x "
                     f"| {vs[0]} | {vs[1]} | {r['ttft_s']:.2f} | {r['ttft_s'] / r['ttft_alone_s']:.2f} "
                     f"| {r['prefill_steps']} | {1e3 * r['mixed_step_s']:.1f} | {err} | {chunk} "
                     f"| {r['runs']} ({r['compiled_in_reported_run']}) |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--multiples", type=float, nargs="+", default=[2, 5, 25],
                    help="targets as multiples of the measured decode step")
    ap.add_argument("--before-steps", type=int, default=20)
    ap.add_argument("--after-steps", type=int, default=5)
    a = ap.parse_args(argv)
    print(report(run(a), a))


if __name__ == "__main__":
    main()
