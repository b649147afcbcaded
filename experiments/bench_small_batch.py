"""Small-batch decode: tokens/s, where an engine step's time goes, and the fraction of the
roofline floor, for this checkout and an earlier revision side by side in one run.

    python experiments/bench_small_batch.py [--before REV] [--batches 1,4] [--models tiny,124m]
                                            [--quantization int4] [--kv-cache-dtype bfloat16]

Models: ``tiny`` is the GPT-2-shaped model of the issue (512 wide, 8 layers, 8 heads, vocabulary
1,024 asked, 703 in its tokenizer, random, float32); ``llama`` the LLaMA that ``bench_llamacpp.py``
runs against llama.cpp (512 wide, 8 layers, intermediate 1,408); ``124m`` the GPT-2-124M shape
(``bench_common.gpt2_124m_model``). For each model, revision and batch size, a fresh child process
(``LLM`` with default options) runs ``batch`` greedy requests (``--prompt-len`` random tokens,
``--output-len`` tokens each, EOS ignored) through ``LLMEngine.step`` and times the decode steps
(the prefill step left out), ``--runs`` times; the fastest run is kept, with its split of the step
from ``engine.get_stats()["timings"]`` (schedule, prepare, device, sample, process), and the device's
idle time between steps (:class:`DeviceIdle`). Beside it, the
jitted step alone (``ModelRunner.run_batch`` on a decode batch at the runs' mean context, waited for,
the best of 50 calls). Where the revision's step returns greedy tokens (``paged_jax.executor.sampling``),
runs in the same child also send them through the sampler instead, the path before, and where it runs
the next decode step ahead (``paged_jax.executor.run_ahead``) runs also go without; the paths take turns
run by run, and the last three columns are the median step times of each path's runs in that child. The floor is ``experiments/roofline.py``'s: the larger of FLOPs over the
matmul rate and bytes (weights, K/V at the mean context, logits) over the read bandwidth, both
measured in this run; "of floor" is floor / step time (float32 weights only: with ``--quantization``
the columns say "-"). ``--quantization`` and ``--kv-cache-dtype`` are passed to ``LLM`` (default: the
model's float32 weights and cache).

The revisions alternate, ``--repeats`` times each, and the best figure of each is kept (a shared
machine only slows a run down). ``--before`` is checked out into a temporary git worktree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "9066e7c"  # main before the small-batch work
TINY = dict(family="gpt2", vocab_size=1024, n_embd=512, n_layer=8, n_head=8)
PARTS = ("schedule", "prepare", "device", "sample", "process")


class DeviceIdle:
    """The time the device had nothing to run between steps, as the host sees it: from a step found
    done (the runner's wait for it returned) with no step run ahead queued behind it
    (``paged_jax.executor.run_ahead``), to the next step's dispatch (``ModelRunner.run_step``)."""

    def __init__(self, runner):
        import jax

        self.seconds, self._since = 0.0, None
        run_step, wait = runner.run_step, jax.block_until_ready

        def dispatch(*args, **kw):
            if self._since is not None:
                self.seconds += time.perf_counter() - self._since
                self._since = None
            return run_step(*args, **kw)

        def waited(x):
            out = wait(x)
            if getattr(runner, "_ahead", None) is None:
                self._since = time.perf_counter()
            return out

        runner.run_step, jax.block_until_ready = dispatch, waited

    def reset(self):
        self.seconds, self._since = 0.0, None


def child(tree: str, model: str, batches: list[int], a) -> dict:
    """Decode steps with ``tree``'s paged_jax (first on the path); one result per batch size."""
    sys.path.insert(0, tree)
    import jax
    import numpy as np

    from paged_jax import LLM, SamplingParams
    from paged_jax.executor.batch import SeqChunk, prepare_batch

    assert Path(__import__("paged_jax").__file__).resolve().is_relative_to(Path(tree).resolve())
    # Only options given: an earlier revision may not know them.
    options = {k: v for k, v in (("quantization", a.quantization), ("kv_cache_dtype", a.kv_cache_dtype)) if v}
    llm = LLM(model, seed=0, max_model_len=a.prompt_len + a.output_len, **options)
    engine = llm.llm_engine
    runner = engine.runner
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    try:  # greedy tokens from the step itself, where the revision has them
        from paged_jax.executor import sampling as step_sampling
    except ImportError:
        step_sampling = None
    argmax_only = getattr(step_sampling, "batch_is_argmax_only", None)
    idle = DeviceIdle(runner)
    results = {}
    # Runs cycle through the paths this revision has, in one process: greedy tokens from the step (the
    # default), through the sampler (the path before), and with no decode step run ahead.
    modes = ["step"] + (["sampler"] if argmax_only else []) + (["no_run_ahead"] if hasattr(runner, "run_ahead") else [])
    for b in batches:
        best, times = None, {m: [] for m in modes}  # step ms of every run, by path
        # The first run compiles the shapes it reaches.
        for run in range(len(modes) * a.runs + 1):
            mode = modes[run % len(modes)]
            if argmax_only is not None:
                step_sampling.batch_is_argmax_only = (lambda *args: False) if mode == "sampler" else argmax_only
            if "no_run_ahead" in modes:
                runner.run_ahead = mode != "no_run_ahead"
            for i in range(b):
                engine.add_request(f"b{b}r{run}s{i}", None, params,
                                   prompt_token_ids=rng.integers(3, vocab, a.prompt_len).tolist())
            engine.step()  # the prompts' prefill
            before = engine.get_stats()["timings"]
            idle.reset()
            steps, t = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            wall = time.perf_counter() - t
            after = engine.get_stats()["timings"]
            if run == 0:
                continue
            r = {"step_ms": 1e3 * wall / steps, "tokens_per_s": b * steps / wall, "idle_ms": 1e3 * idle.seconds / steps,
                 **{k + "_ms": 1e3 * (after[k] - before[k]) / steps for k in PARTS}}
            times[mode].append(r["step_ms"])
            if mode == "step" and (best is None or r["step_ms"] < best["step_ms"]):
                best = r
        if argmax_only is not None:
            step_sampling.batch_is_argmax_only = argmax_only
        if "no_run_ahead" in modes:
            runner.run_ahead = True
        # Medians, the runs alternating: a loaded machine slows some runs of either path by far more
        # than the difference, which a best-of figure then shows as whichever path was luckier.
        best["median_ms"] = float(np.median(times["step"]))
        best["median_via_sampler_ms"] = float(np.median(times["sampler"])) if times.get("sampler") else None
        best["median_no_run_ahead_ms"] = float(np.median(times["no_run_ahead"])) if times.get("no_run_ahead") else None
        # The jitted step alone, at the runs' mean context (blocks past the pool's first are fine:
        # nothing else runs now).
        context = a.prompt_len + a.output_len // 2
        per_seq = -(-context // runner.block_size)
        chunks = [SeqChunk([7], context - 1, list(range(1 + s * per_seq, 1 + (s + 1) * per_seq))) for s in range(b)]
        batch = prepare_batch(chunks, runner.block_size)
        jax.block_until_ready(runner.run_batch(batch))
        alone = []
        for _ in range(50):
            t = time.perf_counter()
            jax.block_until_ready(runner.run_batch(batch))
            alone.append(time.perf_counter() - t)
        best["step_alone_ms"] = 1e3 * min(alone)
        results[b] = best
    return results


def floors(model: str, batches: list[int], context: int, rate: float, bw: float) -> dict:
    from roofline import step_cost

    from paged_jax.executor.loading import load_for_serving
    import jax
    import numpy as np

    cfg, params, _ = load_for_serving(model, "float32", 1, native_kernels=False)  # unpadded: the model's own size
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    out = {}
    for b in batches:
        flops, nbytes = step_cost(cfg, num_params, b, context)
        out[b] = 1e3 * max(flops / rate, nbytes / bw)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=BASE, help="the revision to compare with (git rev); 'none': this checkout only")
    ap.add_argument("--models", default="tiny,124m")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per batch size in a child; the fastest is kept")
    ap.add_argument("--repeats", type=int, default=2, help="children per revision and model, alternating")
    ap.add_argument("--quantization", default=None, help="LLM's quantization (e.g. int8, int4); default none")
    ap.add_argument("--kv-cache-dtype", default=None, help="LLM's kv_cache_dtype (e.g. bfloat16); default the model's")
    ap.add_argument("--child", nargs=3, metavar=("TREE", "MODEL", "BATCHES"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        tree, model, batches = a.child
        print("RESULT " + json.dumps(child(tree, model, [int(x) for x in batches.split(",")], a)), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_common import gpt2_124m_model
    from bench_llamacpp import MODEL as LLAMA
    from roofline import machine_limits

    from paged_jax.models.tiny import make_tiny_model

    from bench_common import child_result, revision_checkout

    with tempfile.TemporaryDirectory() as tmp, revision_checkout(None if a.before == "none" else a.before) as before:
        trees = {"after": str(ROOT)} if before is None else {"before": before, "after": str(ROOT)}
        models = {}
        for name in a.models.split(","):
            small = {"tiny": TINY, "llama": LLAMA}.get(name)
            models[name] = str(make_tiny_model(os.path.join(tmp, name), **small)) if small else gpt2_124m_model()
        results = {}
        for name, model in models.items():
            for rep in range(a.repeats):
                for rev, tree in trees.items():
                    cmd = [sys.executable, __file__, "--child", tree, model, ",".join(map(str, a.batches)),
                           "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len),
                           "--runs", str(a.runs)]
                    cmd += ["--quantization", a.quantization] if a.quantization else []
                    cmd += ["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype else []
                    for b, r in child_result(cmd, f"{rev} {name}").items():
                        print(name, rev, rep, b, {k: v if v is None else round(v, 3) for k, v in r.items()}, file=sys.stderr,
                              flush=True)
                        best = results.setdefault((name, int(b), rev), r)
                        alone = min(r["step_alone_ms"], best["step_alone_ms"])
                        if r["step_ms"] < best["step_ms"]:
                            best = results[(name, int(b), rev)] = dict(r)
                        best["step_alone_ms"] = alone
        rate, bw = machine_limits(10)
        context = a.prompt_len + a.output_len // 2
        floor = {name: floors(model, a.batches, context, rate, bw) if not a.quantization else dict.fromkeys(a.batches)
                 for name, model in models.items()}
    print(f"before: {a.before}; after: this checkout. Decode steps, greedy, prompts of {a.prompt_len} tokens, "
          f"{a.output_len} out; quantization {a.quantization}, kv_cache_dtype {a.kv_cache_dtype or 'auto'}; floor at context {context}: float32 matmul {rate / 1e9:.0f} GFLOP/s, "
          f"memory read {bw / 1e9:.1f} GB/s (measured now)\n")
    print("| model | batch | rev | tokens/s | step ms | of floor | schedule | prepare | device | sample | process "
          "| device idle ms | step alone ms | alone of floor | median step ms | median, greedy via the sampler "
          "| median, no run-ahead |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in models:
        for b in a.batches:
            for rev in trees:
                r, f = results[(name, b, rev)], floor[name][b]
                def of_floor(ms):
                    return "-" if f is None else f"{100 * f / ms:.0f}%"

                print(f"| {name} | {b} | {rev} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
                      f"{of_floor(r['step_ms'])} | " + " | ".join(f"{r[k + '_ms']:.2f}" for k in PARTS)
                      + f" | {r['idle_ms']:.2f} | {r['step_alone_ms']:.2f} | {of_floor(r['step_alone_ms'])} | "
                      + f"{r['median_ms']:.2f} | "
                      + (f"{r['median_via_sampler_ms']:.2f} |" if r.get("median_via_sampler_ms") else "- |")
                      + (f" {r['median_no_run_ahead_ms']:.2f} |" if r.get("median_no_run_ahead_ms") else " - |"))
    if not a.quantization:
        print("\nfloor ms: " + ", ".join(f"{n} batch {b}: {floor[n][b]:.2f}" for n in models for b in a.batches))


if __name__ == "__main__":
    main()
