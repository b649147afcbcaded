"""Long prompts on the CPU: one prompt's prefill through the engine, the dense reference prefill
(before: a ``[prompt, prompt]`` score matrix per head) against the blockwise one (after: the
engine's default, ``"auto"``), side by side in one run, one fresh process per (path, length).

    python experiments/bench_long_prompt.py [--lengths 4096 8192 16384 32768] [--max-planned-gb 8]

The model is a tiny random LLaMA (``make_tiny_model``: 2 layers, 4 query heads, 2 KV heads,
head size 16) with room for the longest prompt. Each child process builds an engine for one
length (``max_model_len`` and ``max_num_batched_tokens`` raised so the prompt runs as one prefill
step, a KV pool just large enough), compiles that step ahead of time, reads the scratch memory
XLA planned for it (``memory_analysis().temp_size_in_bytes``), and, when that fits in
``--max-planned-gb``, runs the prompt twice (``max_tokens=1``: prefill and one sampled token;
the second run is the timed one, no compilation). Peak memory is the child's ``ru_maxrss``;
"over base" is that minus the peak before the first prompt (model, pool, JAX runtime).
The "before" path is the native decode kernel with ``ReferenceBackend.dense_prefill``, which
is exactly what ``"auto"`` ran for prompts before prefill went blockwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import bench_common  # noqa: F401  (puts this checkout on the path)

BLOCK_SIZE = 16
PATHS = {"before": "dense reference prefill", "after": "blockwise prefill (auto)"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def child(model: str, path: str, n: int, max_planned_gb: float) -> dict:
    import jax
    import numpy as np

    from paged_jax import SamplingParams, native
    from paged_jax.attention import REFERENCE, NativeBackend, ReferenceBackend, register_backend
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs
    from paged_jax.executor.batch import Batch, SeqChunk, prepare_part

    backend = "auto"
    if path == "before":
        # What "auto" ran before: native decode (or the reference's, without the kernel) and the dense prefill.
        base = NativeBackend if native.available() else ReferenceBackend

        class DensePrefill(base):
            name = "bench-dense-prefill"

            def prefill(self, q, k_cache, v_cache, meta, spec):
                return REFERENCE.dense_prefill(q, k_cache, v_cache, meta, spec)

        register_backend(DensePrefill())
        backend = "bench-dense-prefill"
    blocks = -(-(n + 1) // BLOCK_SIZE)
    engine = LLMEngine(EngineArgs(model=model, block_size=BLOCK_SIZE, max_model_len=n + 1,
                                  max_num_batched_tokens=n + 1, max_num_seqs=1, num_kv_blocks=blocks + blocks // 32 + 4,  # the watermark holds back 1 %
                                  attention_backend=backend))
    runner = engine.runner
    used = engine.get_stats()["attention_backend"]
    # Compile the prompt's step ahead of time, as warm_up does, to read XLA's plan before running it.
    key = prepare_part([SeqChunk(list(range(n)), 0, list(range(1, blocks + 1)))], n, BLOCK_SIZE).shape_key
    t0 = time.perf_counter()
    compiled = runner._step.lower(runner.params, runner.kv_caches, Batch.abstract(key), False).compile()
    compile_s = time.perf_counter() - t0
    planned = compiled.memory_analysis().temp_size_in_bytes
    runner._executables[(key, False)] = compiled
    out = dict(path=path, n=n, backend=used, shape_key=key, compile_s=compile_s, planned_temp_mb=planned / 2**20,
               base_rss_mb=peak_rss_mb(), ran=False)
    if planned > max_planned_gb * 2**30:
        return out
    rng = np.random.default_rng(n)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, first = [], []
    for i in range(2):  # the first run warms up the sampler and the engine's Python; the second is timed
        prompt = rng.integers(3, 500, size=n).tolist()
        t0 = time.perf_counter()
        engine.add_request(str(i), None, params, prompt)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        times.append(time.perf_counter() - t0)
        assert outs and outs[-1].outputs[0].finish_reason == "length", outs
        first.append(outs[-1].outputs[0].token_ids[0])
    assert runner._compiled == {(key, False)}, (key, runner._compiled)  # the step ran the executable compiled above
    out.update(ran=True, first_run_s=times[0], prefill_s=times[1], peak_rss_mb=peak_rss_mb(), first_tokens=first,
               jax=jax.__version__)
    return out


def run_child(model: str, path: str, n: int, max_planned_gb: float) -> dict:
    cmd = [sys.executable, __file__, "--child", path, str(n), "--model", model,
           "--max-planned-gb", str(max_planned_gb)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return dict(path=path, n=n, ran=False, error=(proc.stderr.strip().splitlines() or ["?"])[-1],
                    returncode=proc.returncode)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> str:
    lines = ["| prompt tokens | path | XLA planned scratch (MiB) | peak RSS (MiB) | over base (MiB) | prefill (s) "
             "| compile (s) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        planned = f"{r['planned_temp_mb']:,.1f}" if "planned_temp_mb" in r else "-"
        if r.get("ran"):
            cells = (f"{r['peak_rss_mb']:,.0f}", f"{r['peak_rss_mb'] - r['base_rss_mb']:,.0f}", f"{r['prefill_s']:.2f}")
        elif "error" in r:
            cells = ("failed", "-", r["error"][:60])
        else:
            cells = ("not run: plan over budget", "-", "-")
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        lines.append(f"| {r['n']:,} | {r['path']} ({PATHS[r['path']]}) | {planned} | {' | '.join(cells)} "
                     f"| {compile_s} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--paths", nargs="+", default=["before", "after"], choices=list(PATHS))
    ap.add_argument("--max-planned-gb", type=float, default=8.0,
                    help="run a step only when XLA plans at most this much scratch for it (a shared machine)")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.child[0], int(a.child[1]), a.max_planned_gb)))
        return
    from paged_jax.models.tiny import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, family="llama", max_position_embeddings=max(a.lengths) + 2 * BLOCK_SIZE))
        for n in a.lengths:
            for path in a.paths:
                r = run_child(model, path, n, a.max_planned_gb)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    print(report(rows))
    done = {(r["path"], r["n"]): r for r in rows if r.get("ran")}
    same = [n for n in a.lengths if ("before", n) in done and ("after", n) in done]
    for n in same:
        b, f = done[("before", n)], done[("after", n)]
        print(f"{n} tokens: same first token before/after: {b['first_tokens'] == f['first_tokens']}; "
              f"prefill {b['prefill_s'] / f['prefill_s']:.1f}x faster after")
    for path in a.paths:  # linear: about the same bytes per added token at every step; quadratic: doubling
        steps = [r for r in rows if r["path"] == path and "planned_temp_mb" in r]
        for lo, hi in zip(steps, steps[1:]):
            grow = lambda key, base=None: ((hi[key] - (hi[base] if base else 0)) - (lo[key] - (lo[base] if base else 0))) \
                * 2**20 / (hi["n"] - lo["n"])
            rss = (f", peak RSS over base {grow('peak_rss_mb', 'base_rss_mb'):,.0f} B"
                   if lo.get("ran") and hi.get("ran") else "")
            print(f"{path}: {lo['n']:,} -> {hi['n']:,} tokens, per added token: planned scratch "
                  f"{grow('planned_temp_mb'):,.0f} B{rss}")

if __name__ == "__main__":
    main()
