"""Where the jitted decode step's time goes, at batch 1 and 4, per weight format.

    python experiments/profile_decode_step.py [--formats float32,int8,int4] [--batches 1,4] [--calls 300]
        [--host-us 500] [--variants unfused,fused] [--trace] [--hlo DIR] [--per-call] [--build=FLAGS --build=FLAGS ...]

Builds ``bench_llamacpp.py``'s LLaMA (512 wide, 8 layers, intermediate 1,408, vocabulary 704,
random float32) once, loads it as float32 and with ``quantization="int8"`` and ``"int4"``
(``LLM`` with default options: the native kernels where they build), each way with Q, K, V and
gate, up left apart (``unfused``) and fused as loading stores them (``fused``,
:mod:`paged_jax.weights.fused`), and for each format and batch size runs the jitted step alone
on a decode batch (every sequence one token at context ``--context``, as ``bench_small_batch.py``
builds it):

- *step*: ``ModelRunner.run_batch`` waited for, the best and the median of ``--calls`` calls, the
  variants alternating in ``--rounds`` rounds (their ratio is the figure to read on a shared
  machine); beside it the process's CPU time and context switches a step, and a jitted step that
  computes nothing on the same arguments (the host's share of a call);
- *census*: the compiled step's entry computation, its operations by kind (each is one XLA:CPU
  thunk: the native kernels' custom calls by target, fusions, scatters, copies, ...);
- ``--trace``: ``jax.profiler``'s per-operation times (XLA:CPU's thunks as the profiler records
  them), summed per step by kind, custom calls by target, the largest first;
- ``--host-us``: a busy wait of so many microseconds before each step, as the engine's host work
  between steps (sampling, scheduling, the next batch) leaves one: steps timed back to back miss
  what that wait costs the next step, and what the matmuls prefetch during it;
- ``--per-call``: one kernel call at one row, from chains of dependent calls in one function, and
  an RMS norm native and in XLA at 1-256 rows;
- ``--build=FLAGS`` (twice or more): the same in child processes, one native build each
  (``PAGED_JAX_NATIVE_FLAGS``; ``--build=`` the default), alternating ``--repeats`` times.

``--hlo DIR`` writes each step's optimized HLO there. Timings on a shared machine vary: compare
figures of one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_common  # (also puts this checkout on the path)

FORMATS = {"float32": None, "int8": "int8", "int4": "int4"}


def decode_batch(runner, batch: int, context: int):
    """A decode step of ``batch`` sequences at ``context`` tokens (their blocks distinct, past the null block)."""
    from paged_jax.executor.batch import SeqChunk, prepare_batch

    per_seq = -(-context // runner.block_size)
    chunks = [SeqChunk([7], context - 1, list(range(1 + s * per_seq, 1 + (s + 1) * per_seq))) for s in range(batch)]
    return prepare_batch(chunks, runner.block_size)


def timed(fn, calls: int, host_us: float = 0) -> list[float]:
    """Microseconds of each of ``calls`` calls of ``fn`` waited for, each after ``host_us`` of busy waiting."""
    import jax

    jax.block_until_ready(fn())
    out = []
    for _ in range(calls):
        end = time.perf_counter() + host_us / 1e6
        while time.perf_counter() < end:  # the engine's host work between steps (a busy main thread)
            pass
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(1e6 * (time.perf_counter() - t))
    return out


def rusage():
    import resource

    import numpy as np

    r = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([r.ru_utime + r.ru_stime, r.ru_nvcsw, r.ru_nivcsw], dtype=float)


def census(hlo: str) -> collections.Counter:
    """The entry computation's operations by kind: custom calls by target, everything else by opcode
    (free ones, parameters, tuples, bitcasts, constants, left out)."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    kinds = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+([\w-]+)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            continue
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            op = "custom-call " + (target.group(1) if target else "?")
        elif op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            op = "fusion " + (kind.group(1) if kind else "")
        kinds[op] += 1
    return kinds


def trace_ops(call, calls: int) -> tuple[dict, float]:
    """(per-op microseconds a step by event name, the executable's span a step) from a jax.profiler trace."""
    import jax

    jax.block_until_ready(call())

    def run():
        for _ in range(calls):
            jax.block_until_ready(call())

    events = bench_common.profiler_events(run)
    totals = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            totals[e["name"]] += e["dur"] / calls
    return dict(totals)


def grouped(ops: dict, hlo: str) -> dict:
    """Event names without their instance numbers (``fusion.12`` -> ``fusion``), a custom call's by
    its target (from the HLO), and how many instances each has."""
    targets = dict(re.findall(r"%([\w.-]+) = [^\n]*custom_call_target=\"([^\"]+)\"", hlo))
    out, count = collections.defaultdict(float), collections.Counter()
    for name, us in ops.items():
        key = targets.get(name) or re.sub(r"(\.\d+)+$", "", name)
        out[key] += us
        count[key] += 1
    return {k: (us, count[k]) for k, us in out.items()}


def per_call(calls: int) -> None:
    """Microseconds a call of one kernel at one row, from chains of 1 and 33 dependent calls in one
    jitted function (the difference over 32: no dispatch, no argument handling), beside the bytes of
    weight it reads at the machine's read bandwidth; and of one XLA operation kept apart by
    optimization barriers (one thunk each)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax import native
    from paged_jax.weights import DenseLinear
    from paged_jax.weights.methods.on_load import quantize_weight
    from paged_jax.weights.panels import to_panels

    rng = np.random.default_rng(0)
    big = jnp.asarray(rng.standard_normal(1 << 26).astype(np.float32))  # 256 MiB
    read = jax.jit(native.read_sum)
    bw = max(big.nbytes / (1e-6 * min(timed(lambda: read(big), 5))), 1.0)
    x = jnp.asarray(rng.standard_normal((1, 512)).astype(np.float32))

    def chain(f, n):
        def run(w, x):
            for _ in range(n):
                x = f(w, x)[..., :512]
            return x
        return jax.jit(run)

    print(f"\n## one call at one row (read bandwidth {bw / 1e9:.1f} GB/s measured)")
    for name, method in (("float32", None), ("int8", "int8"), ("int4 x q8", "int4")):
        for K, N in ((512, 512), (512, 1536), (512, 2816)):
            w = DenseLinear(jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * 0.05))
            w = to_panels({"w": w if method is None else quantize_weight(w, method)}, int4_int8=True)["w"]
            nbytes = sum(a.nbytes for a in jax.tree.leaves(w))
            one, many = chain(lambda w, x: w(x), 1), chain(lambda w, x: w(x), 33)
            t1 = min(timed(lambda: one(w, x), calls))
            t33 = min(timed(lambda: many(w, x), calls // 4))
            print(f"  {name} [{K}, {N}] {nbytes / 1e3:.0f} kB: {(t33 - t1) / 32:.1f} us a call "
                  f"(its bytes at the bandwidth: {1e6 * nbytes / bw:.1f} us); one call jitted alone {t1:.1f} us")

    def op_chain(n):
        def run(x):
            for _ in range(n):
                x = jax.lax.optimization_barrier(jnp.tanh(x))
            return x
        return jax.jit(run)

    one, many = op_chain(1), op_chain(33)
    t1, t33 = min(timed(lambda: one(x), calls)), min(timed(lambda: many(x), calls // 4))
    print(f"  XLA tanh of 512 floats: {(t33 - t1) / 32:.1f} us an operation; one jitted alone {t1:.1f} us")

    # The RMS norm, native (one operation) and as XLA compiles the jnp expression (four), by rows
    from paged_jax.models.layers import rms_norm

    def norm_chain(native_norm, n):
        def run(x, w):
            for _ in range(n):
                x = rms_norm(x, w, 1e-6, native_norm)
            return x
        return jax.jit(run)

    w = jnp.asarray(rng.uniform(0.5, 1.5, 512).astype(np.float32))
    for rows in (1, 8, 48, 256):
        xs = jnp.asarray(rng.standard_normal((rows, 512)).astype(np.float32))
        us = {}
        for name, flag in (("native", True), ("XLA", False)):
            one, many = norm_chain(flag, 1), norm_chain(flag, 33)
            t1, t33 = min(timed(lambda: one(xs, w), calls)), min(timed(lambda: many(xs, w), calls // 4))
            us[name] = (t33 - t1) / 32
        print(f"  RMS norm of [{rows}, 512]: native {us['native']:.1f} us, XLA {us['XLA']:.1f} us a norm "
              f"({us['XLA'] / us['native']:.1f}x)")


def compare_builds(a, argv) -> None:
    import os
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    child_args = [x for x in argv if not x.startswith("--build=")]
    if "--repeats" in child_args:
        k = child_args.index("--repeats")
        del child_args[k:k + 2]
    runs = {flags: [] for flags in a.builds}
    for rep in range(a.repeats):
        for flags in a.builds:
            env = dict(os.environ, PAGED_JAX_NATIVE_FLAGS=flags)
            out = subprocess.run([sys.executable, __file__, *child_args], env=env, capture_output=True, text=True)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"child with {flags!r} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            runs[flags].append(json.loads(line[len("RESULT "):]))
            print(f"repeat {rep} {flags or 'default'}: " + ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}"
                                                                for k, v in runs[flags][-1].items()), flush=True)
    keys = list(runs[a.builds[0]][0])
    print("\n| case | " + " | ".join(f"{f or 'default'} best / median us" for f in a.builds) + " | ratios to the first |")
    print("|---|" + "---:|" * (len(a.builds) + 1))
    for key in keys:
        cells, ratios = [], []
        for flags in a.builds:
            best = min(r[key][0] for r in runs[flags])
            median = statistics.median(r[key][1] for r in runs[flags])
            cells.append(f"{best:.0f} / {median:.0f}")
            ratios.append((best, median))
        first = ratios[0]
        print(f"| {key} | " + " | ".join(cells) + " | " +
              ", ".join(f"{b / first[0]:.2f} / {m / first[1]:.2f}" for b, m in ratios[1:]) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="float32,int8,int4")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--context", type=int, default=96)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--host-us", type=float, default=0,
                    help="busy-wait so many microseconds before each step (the engine's host work between steps)")
    ap.add_argument("--trace", action="store_true", help="also jax.profiler's per-operation times")
    ap.add_argument("--top", type=int, default=25, help="trace: the largest so many event names")
    ap.add_argument("--hlo", help="write each step's optimized HLO into this folder")
    ap.add_argument("--variants", default="unfused,fused",
                    help="unfused: Q, K, V and gate, up left apart (paged_jax.weights.fused off); fused: as loaded")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of calls, the variants alternating")
    ap.add_argument("--per-call", action="store_true", help="also the cost of one kernel call at one row")
    ap.add_argument("--loop", type=float, help="only call the first format's first batch size for so many seconds "
                                               "(to run under perf)")
    ap.add_argument("--build", action="append", metavar="FLAGS", dest="builds",
                    help="compare native builds, each --build=FLAGS (PAGED_JAX_NATIVE_FLAGS; --build= the default): "
                         "child processes alternating, --repeats times each, the best and the median of their figures")
    ap.add_argument("--repeats", type=int, default=3, help="--builds: children per build")
    a = ap.parse_args(argv)
    if a.builds:
        return compare_builds(a, argv)

    import jax
    import numpy as np

    from bench_llamacpp import MODEL
    from paged_jax import LLM, native
    from paged_jax.models.tiny import make_tiny_model

    nothing = jax.jit(lambda params, kv, batch: batch.input_ids[:1])
    print(f"jax {jax.__version__}, native paths {native.paths() if native.available() else 'none'}")
    if a.per_call:
        per_call(a.calls)
    prepare = sys.modules["paged_jax.weights.prepare"]
    fuse = prepare.fuse_inputs
    variants = {"unfused": lambda params: params, "fused": fuse}
    variants = {v: variants[v] for v in a.variants.split(",")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "model", **MODEL))
        for fmt in a.formats.split(","):
            runners = {}
            for v, how in variants.items():
                prepare.fuse_inputs = how
                runners[v] = LLM(model, seed=0, quantization=FORMATS[fmt], max_model_len=a.context + 32).llm_engine.runner
            prepare.fuse_inputs = fuse
            for b in a.batches:
                batches = {v: decode_batch(r, b, a.context) for v, r in runners.items()}
                if a.loop:
                    v = next(iter(runners))
                    jax.block_until_ready(runners[v].run_batch(batches[v]))
                    print("looping", flush=True)
                    end, n = time.perf_counter() + a.loop, 0
                    while time.perf_counter() < end:
                        jax.block_until_ready(runners[v].run_batch(batches[v]))
                        n += 1
                    print(f"{n} steps, {1e6 * a.loop / n:.0f} us a step")
                    return
                # the variants alternating in rounds, so that the machine's load falls on each alike
                steps = {v: [] for v in runners}
                usage = {v: np.zeros(3) for v in runners}  # CPU seconds, voluntary and involuntary switches
                for _ in range(a.rounds):
                    for v, r in runners.items():
                        before = rusage()
                        steps[v] += timed(lambda: r.run_batch(batches[v]), max(1, a.calls // a.rounds), a.host_us)
                        usage[v] += rusage() - before
                for v, r in runners.items():
                    batch = batches[v]
                    empty = timed(lambda: nothing(r.params, r.kv_caches, batch), a.calls)
                    leaves = jax.tree.leaves((r.params, r.kv_caches, batch))
                    print(f"\n## {fmt}, batch {b}, {v}: step best {min(steps[v]):.0f} us, median "
                          f"{statistics.median(steps[v]):.0f} us; an empty step on the same {len(leaves)} argument "
                          f"arrays best {min(empty):.0f} us")
                    n = len(steps[v]) + a.rounds  # timed() makes one call more a round
                    print(f"process CPU time {1e6 * usage[v][0] / n:.0f} us a step (all threads; the wall time's mean "
                          f"{statistics.mean(steps[v]):.0f} us), context switches a step: {usage[v][1] / n:.1f} "
                          f"voluntary, {usage[v][2] / n:.1f} involuntary")
                    compiled = r._executables.get((batch.shape_key, False)) or r._compile(batch, False)
                    hlo = compiled.as_text()
                    if a.hlo:
                        Path(a.hlo).mkdir(parents=True, exist_ok=True)
                        (Path(a.hlo) / f"{fmt}_b{b}_{v}.txt").write_text(hlo)
                    kinds = census(hlo)
                    print(f"census: {sum(kinds.values())} operations: " +
                          ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
                    if a.trace:
                        ops = trace_ops(lambda: r.run_batch(batch), a.calls)
                        print("trace, us a step by event (instances summed):")
                        for name, (us, n) in sorted(grouped(ops, hlo).items(), key=lambda kv: -kv[1][0])[:a.top]:
                            print(f"  {us:9.1f} us  {name} ({n})")
                for v in runners:
                    results[f"{fmt} batch {b} {v}"] = [min(steps[v]), statistics.median(steps[v])]
                if len(runners) == 2:
                    (v0, t0), (v1, t1) = steps.items()
                    print(f"\n{fmt}, batch {b}: {v1} over {v0}, step time: best {min(t1) / min(t0):.3f}, median "
                          f"{statistics.median(t1) / statistics.median(t0):.3f}")
            del runners
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
