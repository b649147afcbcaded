"""One call of the int4 x int8 matmul (``linear_int4.cc``) at one row, its weights streamed from memory.

    python experiments/bench_int4_call.py [--before REV] [--source NAME=FILE ...] [--mb 64] [--repeats 5]

Each of ``bench_llamacpp.py``'s LLaMA layer shapes (q/k/v [512, 1536], o [512, 512], gate+up [512, 2816],
down [1408, 512]) as random int4 panels and float32 scales (groups of 32 rows), run as:

- *streamed*: one jitted chain of dependent calls over distinct weights, ``--mb`` megabytes of them
  (past the L3 cache), so every call reads its weight from memory: microseconds a call (the chain
  over its length) and GB/s of panels + scales;
- *cached*: the same chain over one weight, which stays in cache;
- *model*: the 32 weights of the 8 layers in order (16 MB, as the decode step reads them);

beside the plain read bandwidth (``native.read_sum`` over ``--mb`` megabytes of float32) and the
call's fixed parts: a one-panel call at K = 32 (dispatch, quantizing one block), the same with two
panels (the thread pool's wake-up and join on top), one panel at K = 512 and 1,408 (quantizing the
activations and one panel's dot loop). Every call's input is the previous one's output (a slice,
or three copies for the down projection: one small XLA fusion a call, the same for every kernel).

``--one-core``: instead, ``bench_int4_one_core.cc`` (one thread's loop over the same shapes, thread
CPU time, beside a plain read of the same bytes and the activations' quantizing alone) built against
each version.

``--before REV`` and ``--source NAME=FILE`` build other versions of ``linear_int4.cc`` (from a git
revision, with its ``parallel.h``, or a file beside this checkout's ``parallel.h``) into their own
libraries, registered under their own names, and time them interleaved with the checkout's kernel
(best of ``--repeats`` rounds: on a shared machine the ratios are the figures to read); each
version's outputs are compared with the checkout's, bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common  # (also puts this checkout on the path)

SHAPES = {"qkv": (512, 1536), "o": (512, 512), "gate_up": (512, 2816), "down": (1408, 512)}
NATIVE = Path(bench_common.ROOT) / "paged_jax" / "native"


def version_dir(name: str, source: str, tmp: Path) -> Path:
    """A folder holding ``source``'s linear_int4.cc (a git revision's or a file) and its parallel.h."""
    d = tmp / name
    d.mkdir()
    if Path(source).is_file():
        shutil.copy(source, d / "linear_int4.cc")
        shutil.copy(NATIVE / "parallel.h", d / "parallel.h")
    else:
        for f in ("linear_int4.cc", "parallel.h"):
            text = subprocess.run(["git", "-C", str(bench_common.ROOT), "show", f"{source}:paged_jax/native/{f}"],
                                  check=True, capture_output=True, text=True).stdout
            (d / f).write_text(text)
    return d


def compile_with(what: list, out: Path, *extra) -> None:
    """The native build's compiler and flags (``PAGED_JAX_NATIVE_FLAGS`` included) on ``what``."""
    import jax.ffi

    from paged_jax.native import build

    cxx = shlex.split(shutil.which("g++") or shutil.which("c++") or "c++")
    flags = [f for f in build._flags() if f not in ("-shared", "-fPIC")] if extra else build._flags()
    subprocess.run([*cxx, *flags, *extra, f"-I{jax.ffi.include_dir()}", *map(str, what), "-o", str(out)], check=True)


def build_version(name: str, source: str, tmp: Path) -> str:
    """Compile one linear_int4.cc (a git revision's or a file) alone into a library, register its
    handler as ``paged_jax_linear_q4i8_<name>``; returns the target's name."""
    import jax.ffi

    d = version_dir(name, source, tmp)
    lib = d / "lib.so"
    compile_with([d / "linear_int4.cc"], lib)
    target = f"paged_jax_linear_q4i8_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(ctypes.cdll.LoadLibrary(str(lib)).LinearQ4I8), platform="cpu")
    return target


def weights(rng, K: int, N: int, count: int):
    """``count`` distinct random int4 weights [K, N]: panels [P, K / 8, W * 4] uint8, scales [P, K / 32, W]."""
    import jax.numpy as jnp

    from paged_jax import native

    W = native.panel_width(N)
    P = N // W
    panels = rng.integers(0, 256, size=(count, P, K // 8, W * 4), dtype="uint8")
    scales = rng.uniform(-0.1, 0.1, size=(count, P, K // 32, W)).astype("float32")
    return [(jnp.asarray(p), jnp.asarray(s)) for p, s in zip(panels, scales)]


def chain(target: str, shapes: list):
    """A jitted function of (x, weights) running the kernel over each weight in turn, each call's
    input made from the previous call's output; returns the last output."""
    import jax
    import jax.numpy as jnp

    def run(x, ws):
        for (K, N), (p, s) in zip(shapes, ws):
            if x.shape[1] != K:
                x = jnp.concatenate([x] * -(-K // x.shape[1]), axis=1)[:, :K]
            x = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1, N), jnp.float32))(x, p, s)
        return x

    return jax.jit(run)


def best_time(f, args, calls: int = 5) -> float:
    import jax

    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def one_core(sources: dict, tmp: Path, mb: float, repeats: int) -> None:
    """bench_int4_one_core.cc built against each version's linear_int4.cc, run alternately, its lines printed."""
    bins = {}
    for i, (name, source) in enumerate(sources.items()):
        d = version_dir(f"one_core{i}", source, tmp) if source else NATIVE
        bins[name] = tmp / f"one_core{i}.bin"
        compile_with([Path(__file__).with_name("bench_int4_one_core.cc")], bins[name],
                     f"-DKERNEL=\"{d / 'linear_int4.cc'}\"")
    for r in range(max(1, repeats // 2)):
        for name, path in bins.items():
            out = subprocess.run([str(path), str(mb), "5"], check=True, capture_output=True, text=True).stdout
            print(f"{name}: {out.strip()}")


def step_times(targets: dict, tmp: Path, repeats: int, best: dict) -> None:
    """Into ``best[version, "decode step, batch 1"]``: the jitted step's best seconds over ``repeats``
    rounds of 50 steps, one runner per version (its kernel's target put in at tracing), alternating."""
    import jax
    from bench_llamacpp import MODEL
    from profile_decode_step import decode_batch

    from paged_jax import LLM, native
    from paged_jax.models.tiny import make_tiny_model

    model = str(make_tiny_model(tmp / "model", **MODEL))
    runs = {}
    saved = native.build.INT4_TARGET
    # compiled steps on disk are keyed without the kernel's target: each version's step compiled here
    os.environ["PAGED_JAX_NO_EXECUTABLE_CACHE"] = "1"
    try:
        for t, target in targets.items():
            native.build.INT4_TARGET = (target, saved[1])
            runner = LLM(model, seed=0, quantization="int4", max_model_len=128).llm_engine.runner
            batch = decode_batch(runner, 1, 96)
            jax.block_until_ready(runner.run_batch(batch))
            runs[t] = (runner, batch)
    finally:
        native.build.INT4_TARGET = saved
    names = list(runs)
    for r in range(repeats):
        for t in names[r % len(names):] + names[:r % len(names)]:
            runner, batch = runs[t]
            best[t, "decode step, batch 1"] = min(best.get((t, "decode step, batch 1"), float("inf")),
                                                  best_time(lambda: runner.run_batch(batch), (), 50))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="also the linear_int4.cc of this git revision")
    ap.add_argument("--source", action="append", default=[], metavar="NAME=FILE",
                    help="also this file's linear_int4.cc (with the checkout's parallel.h)")
    ap.add_argument("--mb", type=float, default=64, help="megabytes of distinct weights a streamed chain reads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step", action="store_true",
                    help="also the jitted decode step at batch 1 (bench_llamacpp.py's LLaMA, quantization=\"int4\") "
                         "with each version's kernel, the versions alternating")
    ap.add_argument("--one-core", action="store_true",
                    help="only bench_int4_one_core.cc: one thread's loop against a plain read of the same bytes "
                         "(versions whose Panel<W> is called as the checkout's)")
    ap.add_argument("--cases", help="only the cases whose names contain one of these (comma-separated) words")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax import native

    assert native.available(), native.status()
    targets = {"checkout": native.INT4_TARGET[0]}
    with tempfile.TemporaryDirectory() as tmp:
        if a.one_core:
            sources = {"checkout": None, **({f"before ({a.before})": a.before} if a.before else {}),
                       **dict(spec.partition("=")[::2] for spec in a.source)}
            return one_core(sources, Path(tmp), a.mb, a.repeats)
        if a.before:
            targets[f"before ({a.before})"] = build_version("before", a.before, Path(tmp))
        for i, spec in enumerate(a.source):
            name, _, path = spec.partition("=")
            targets[name] = build_version(f"source{i}", path, Path(tmp))

        rng = np.random.default_rng(0)
        cases = {}  # name -> (shapes, weights, bytes read)
        for name, (K, N) in SHAPES.items():
            one = weights(rng, K, N, 1)
            nbytes = sum(p.nbytes + s.nbytes for p, s in one)
            count = max(2, int(a.mb * 1e6 / nbytes))
            cases[f"{name} [{K}, {N}] streamed"] = ([(K, N)] * count, one + weights(rng, K, N, count - 1), nbytes * count)
            cases[f"{name} [{K}, {N}] cached"] = ([(K, N)] * count, one * count, nbytes * count)
        layers = [weights(rng, K, N, 1)[0] for _ in range(8) for K, N in SHAPES.values()]
        cases["model: 8 layers x 4"] = (list(SHAPES.values()) * 8, layers,
                                        sum(p.nbytes + s.nbytes for p, s in layers))
        for label, (K, N) in {"fixed: 1 panel, K 32": (32, 16), "fixed: 2 panels, K 32": (32, 96),
                              "1 panel, K 512": (512, 16), "1 panel, K 1408": (1408, 16)}.items():
            cases[label] = ([(K, N)] * 200, weights(rng, K, N, 1) * 200, 0)

        if a.cases:
            cases = {c: v for c, v in cases.items() if any(w in c for w in a.cases.split(","))}
        x = jnp.asarray(rng.standard_normal((1, 512)).astype(np.float32))
        fns = {(t, c): chain(target, cases[c][0]) for t, target in targets.items() for c in cases}
        for (t, c), f in fns.items():  # every version's outputs against the checkout's, bit for bit
            out = np.asarray(f(x, cases[c][1]))
            ref = np.asarray(fns["checkout", c](x, cases[c][1]))
            if not np.array_equal(out, ref, equal_nan=True):
                sys.exit(f"{t} differs from the checkout's kernel on {c}")
        flat = jnp.asarray(rng.standard_normal(int(a.mb * 1e6 / 4)).astype(np.float32))
        read = jax.jit(native.read_sum)
        best, read_s = {}, float("inf")
        names = list(targets)
        for r in range(a.repeats):
            read_s = min(read_s, best_time(read, (flat,), 3))
            for c in cases:
                for t in names[r % len(names):] + names[:r % len(names)]:  # each version first in turn
                    best[t, c] = min(best.get((t, c), float("inf")), best_time(fns[t, c], (x, cases[c][1]), 2))
        bw = flat.nbytes / read_s
        print(f"paths {native.paths()['linear int4 x int8']}; read bandwidth (read_sum, {flat.nbytes / 1e6:.0f} MB) "
              f"{bw / 1e9:.1f} GB/s")
        if a.step:
            step_times(targets, Path(tmp), a.repeats, best)
        print("\n| one row | " + " | ".join(f"{t}: us a call (GB/s)" for t in names) +
              (" | over the checkout |" if len(names) > 1 else " |"))
        print("|---|" + "---:|" * (len(names) + (len(names) > 1)))
        steps = {"decode step, batch 1": ([None], None, 0)} if a.step else {}
        for c, (shapes, _, nbytes) in {**cases, **steps}.items():
            cells, us = [], []
            for t in names:
                s = best[t, c]
                us.append(1e6 * s / len(shapes))
                cells.append(f"{us[-1]:.1f}" + (f" ({nbytes / s / 1e9:.1f})" if nbytes else ""))
            ratios = " | " + ", ".join(f"{u / us[0]:.3f}" for u in us[1:]) if len(names) > 1 else ""
            floor = f", floor {1e6 * nbytes / len(shapes) / bw:.1f}" if nbytes else ""
            print(f"| {c}{floor} | " + " | ".join(cells) + ratios + " |")


if __name__ == "__main__":
    main()
