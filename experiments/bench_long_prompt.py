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
is exactly what ``"auto"`` ran for prompts before prefill went blockwise; ``--paths blockwise``
adds the blockwise jnp prefill in query tiles (``ReferenceBackend.prefill``), what ``"auto"`` ran
before the native kernel took whole ragged steps; "after" is ``"auto"`` now.

Stutter mode (``--stutter``): streams decoding while a long prompt arrives, one process, side by side:

    python experiments/bench_long_prompt.py --stutter [--prompt-len 4000] [--streams 16] [--budgets 64 128 256 512 1024]

The model is GPT-2-shaped (512 wide, 8 layers, 8 heads, vocabulary 1,024, random float32). For chunked
prefill off and for chunked prefill on at each budget (``max_num_batched_tokens``), a fresh engine with
otherwise default options: ``--streams`` requests (32-token prompts, greedy, EOS ignored) decode for
``--before-steps`` steps, then the long prompt is added (``LLMEngine.add_request``) and ``step`` runs,
each step timed, until the long prompt has its first token, then ``--after-steps`` more. A stream's
inter-token gap is the time between the ends of two steps that gave it a token. Reported: the streams'
max and p99 gap during the long prefill (the gaps that end from the step the prompt arrived in to the
step that gave its first token) over their median gap before it; the share of the long prefill's steps
in which every stream got a token; the long prompt's time to first token (from ``add_request`` to the
end of that step) against the same prompt prefilled alone on the same engine. Each configuration runs
its scenario twice and the prompt alone twice (the first of each compiles); the second is reported.
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
PATHS = {"before": "dense reference prefill", "blockwise": "blockwise jnp prefill in query tiles",
         "after": "native ragged kernel (auto)"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def child(model: str, path: str, n: int, max_planned_gb: float) -> dict:
    import jax
    import numpy as np

    from paged_jax import SamplingParams, native
    from paged_jax.attention import REFERENCE, NativeBackend, ReferenceBackend, register_backend
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs
    from paged_jax.executor.batch import Batch, SeqChunk, prepare_batch

    backend = "auto"
    if path in ("before", "blockwise"):
        # What "auto" ran before: native decode (or the reference's, without the kernel) and the dense
        # prefill; then the blockwise jnp prefill in query tiles, before the native kernel took whole steps.
        base = NativeBackend if native.available() else ReferenceBackend

        class TiledPrefill(base):
            name = f"bench-{path}-prefill"
            ragged = None  # the layer's decode + query tiles path, so that this prefill runs

            def prefill(self, q, k_cache, v_cache, meta, spec):
                run = REFERENCE.dense_prefill if path == "before" else REFERENCE.prefill
                return run(q, k_cache, v_cache, meta, spec)

        register_backend(TiledPrefill())
        backend = TiledPrefill.name
    blocks = -(-(n + 1) // BLOCK_SIZE)
    engine = LLMEngine(EngineArgs(model=model, block_size=BLOCK_SIZE, max_model_len=n + 1,
                                  max_num_batched_tokens=n + 1, max_num_seqs=1, num_kv_blocks=blocks + blocks // 32 + 4,  # the watermark holds back 1 %
                                  attention_backend=backend))
    runner = engine.runner
    used = engine.get_stats()["attention_backend"]
    # Compile the prompt's step ahead of time, as warm_up does, to read XLA's plan before running it.
    key = prepare_batch([SeqChunk(list(range(n)), 0, list(range(1, blocks + 1)))], BLOCK_SIZE).shape_key
    t0 = time.perf_counter()
    compiled = runner._step.lower(runner.param_leaves, runner.kv_caches, Batch.abstract(key), False).compile()
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


# ---- stutter mode: streams decoding while a long prompt prefills ----------------------------------
STUTTER_MODEL = dict(family="gpt2", vocab_size=1024, n_embd=512, n_layer=8, n_head=8)


def _ms(x: float) -> str:
    return f"{1e3 * x:,.1f}"


def stutter_run(engine, streams: int, long_prompt: list[int], before: int, after: int, rng, tag: str) -> dict:
    """One scenario on ``engine``: ``streams`` requests decode, then ``long_prompt`` arrives. Returns the
    streams' gaps before and during the long prefill, the long prompt's time to first token, step times."""
    import numpy as np

    from paged_jax import SamplingParams

    vocab = engine.model_config.vocab_size
    stream_params = SamplingParams(temperature=0, max_tokens=before + after + len(long_prompt) + 64, ignore_eos=True)
    ids = [f"{tag}-s{i}" for i in range(streams)]
    for rid in ids:
        engine.add_request(rid, None, stream_params, rng.integers(3, vocab, size=32).tolist())
    counts = dict.fromkeys(ids, 0)
    last = {}  # stream -> end of the step that gave its last token
    gaps_before, gaps_during, step_times = [], [], []
    long_id, t_add, ttft, phase, after_left = f"{tag}-long", None, None, "start", after
    prefill_steps = full_steps = 0
    while True:
        if phase == "start" and all(counts[r] >= 2 for r in ids):
            phase, before_left = "before", before
        if phase == "before" and before_left == 0:
            engine.add_request(long_id, None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                               long_prompt)
            t_add, phase = time.perf_counter(), "during"
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        step_times.append((phase, t1 - t0))
        got = set()
        for o in outs:
            if o.request_id in counts:
                n = len(o.outputs[0].token_ids)
                if n > counts[o.request_id]:
                    got.add(o.request_id)
                    counts[o.request_id] = n
            elif o.request_id == long_id and o.outputs[0].token_ids and ttft is None:
                ttft = t1 - t_add
        for rid in got:
            if rid in last and phase in ("before", "during"):
                (gaps_before if phase == "before" else gaps_during).append(t1 - last[rid])
            last[rid] = t1
        if phase == "before":
            before_left -= 1
        elif phase == "during":
            prefill_steps += 1
            full_steps += len(got) == streams
            if ttft is not None:
                phase = "after"
        elif phase == "after":
            after_left -= 1
            if after_left == 0:
                break
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    med = float(np.median(gaps_before))
    dec = [t for p, t in step_times if p == "before"]
    mixed = [t for p, t in step_times if p == "during"]
    return dict(median_gap_before_s=med, max_gap_during_s=max(gaps_during),
                p99_gap_during_s=float(np.percentile(gaps_during, 99)), ttft_s=ttft, prefill_steps=prefill_steps,
                steps_every_stream_served=full_steps, decode_step_s=float(np.median(dec)),
                mixed_step_s=float(np.median(mixed)))


def stutter_alone(engine, long_prompt: list[int], tag: str) -> float:
    from paged_jax import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(f"{tag}-alone", None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), long_prompt)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs and outs[-1].outputs[0].token_ids
    return time.perf_counter() - t0


def stutter(a) -> list[dict]:
    import numpy as np

    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs
    from paged_jax.models.tiny import make_tiny_model

    configs = [("off", None)] * ("off" in a.chunked) + [("on", None)] * ("default" in a.chunked) + \
        [("on", b) for b in a.budgets]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, n_positions=a.prompt_len + 128, **STUTTER_MODEL))
        for chunked, budget in configs:
            engine = LLMEngine(EngineArgs(model=model, enable_chunked_prefill=chunked == "on",
                                          max_num_batched_tokens=budget, max_model_len=a.prompt_len + 128))
            cfg = engine.scheduler_config
            rng = np.random.default_rng(0)
            vocab = engine.model_config.vocab_size
            runs, alone = [], []
            for rep in range(2):  # the first of each compiles the shapes it reaches
                prompt = rng.integers(3, vocab, size=a.prompt_len).tolist()
                runs.append(stutter_run(engine, a.streams, prompt, a.before_steps, a.after_steps, rng, f"r{rep}"))
                alone.append(stutter_alone(engine, prompt, f"r{rep}"))
            r = dict(chunked=chunked, budget=cfg.max_num_batched_tokens, budget_given=budget is not None,
                     **runs[-1], ttft_alone_s=alone[-1], compilations=engine.get_stats()["num_compilations"])
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            del engine
    return rows


def stutter_report(rows: list[dict], a) -> str:
    lines = [f"{a.streams} streams decoding, a {a.prompt_len:,}-token prompt arrives (GPT-2-shaped: 512 wide, "
             "8 layers; float32; CPU)", "",
             "| chunked prefill | token budget | streams' max gap / median before | p99 gap / median | "
             "steps of the long prefill (every stream served) | long prompt's TTFT (s) | alone (s) | TTFT / alone "
             "| decode step (ms) | mixed step (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        med = r["median_gap_before_s"]
        budget = f"{r['budget']:,}" + ("" if r["budget_given"] else " (default)")
        lines.append(f"| {r['chunked']} | {budget} | {r['max_gap_during_s'] / med:.1f}x | "
                     f"{r['p99_gap_during_s'] / med:.1f}x | {r['prefill_steps']} ({r['steps_every_stream_served']}) "
                     f"| {r['ttft_s']:.2f} | {r['ttft_alone_s']:.2f} | {r['ttft_s'] / r['ttft_alone_s']:.2f} "
                     f"| {_ms(r['decode_step_s'])} | {_ms(r['mixed_step_s'])} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--paths", nargs="+", default=["before", "after"], choices=list(PATHS))
    ap.add_argument("--max-planned-gb", type=float, default=8.0,
                    help="run a step only when XLA plans at most this much scratch for it (a shared machine)")
    ap.add_argument("--stutter", action="store_true", help="streams decoding while a long prompt arrives (see above)")
    ap.add_argument("--prompt-len", type=int, default=4000, help="--stutter: the long prompt's tokens")
    ap.add_argument("--streams", type=int, default=16, help="--stutter: requests decoding when it arrives")
    ap.add_argument("--budgets", type=int, nargs="*", default=[64, 128, 256, 512, 1024],
                    help="--stutter: max_num_batched_tokens values to run with chunked prefill on")
    ap.add_argument("--chunked", nargs="*", default=["off", "default"], choices=["off", "default"],
                    help="--stutter: also run chunked prefill off, and on with the engine's default budget")
    ap.add_argument("--before-steps", type=int, default=20)
    ap.add_argument("--after-steps", type=int, default=5)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.child[0], int(a.child[1]), a.max_planned_gb)))
        return
    if a.stutter:
        print(stutter_report(stutter(a), a))
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
