"""The native matmuls against XLA's, per instruction set the library is built for, side by side in one run.

    python experiments/bench_matmul_isa.py [--rows 1 8 32 128] [--repeats 7]

For each build (default flags: -march=native; ``-mno-avx512f``: this CPU's AVX2 + FMA3 paths; and
``-mno-avx512f -mno-avx2 -mno-fma``: the portable loops), in its own process (the paths are fixed
when the library is compiled) and alternating the builds round by round: microseconds per call of
the layer matmuls of a LLaMA 512 wide (intermediate 1,408: q/k/v/o, gate+up, down, summed) at each
row count, for XLA's float32 dot, the native float32 panels, int8, int4 (groups of 32; by the
float32 kernel, and by the int4 x int8 one, "x q8", that ``quantization="int4"`` runs) and W8A8 weights (the quantized ones as the engine runs them: on builds without AVX-512, XLA's
dequantize-then-matmul past ``native.quantized_native_rows``); the fastest of ``--repeats`` rounds of 20 calls, the kinds
interleaved in each round and the builds run ``--rounds`` times in turn. Prints each one's ratio to XLA's
float32 dot in the same process (XLA's generated code held to the same instruction set with
``--xla_cpu_max_isa``). On an AVX-512 machine the AVX2 rows are that machine with AVX-512 turned
off, not an AVX2 CPU, and XLA's float32 dots there are not held back: XLA hands them to YNNPACK,
which picks its AVX-512 kernels at run time whatever ``--xla_cpu_max_isa`` says (one core: about
110 GMAC/s at 32 x 512 x 1,920, where AVX2's two 8-lane FMAs a cycle top out near 64), so the
"XLA float32" of the AVX2 rows is faster than on a CPU that only has AVX2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# name: (PAGED_JAX_NATIVE_FLAGS, XLA's own --xla_cpu_max_isa: XLA's generated code held to the same set)
BUILDS = {"native": ("", None), "avx2 (AVX-512 off)": ("-mno-avx512f", "AVX2"),
          "portable": ("-mno-avx512f -mno-avx2 -mno-fma", "SSE4_2")}
SHAPES = [(512, 1536), (512, 512), (512, 2816), (1408, 512)]  # qkv, o, gate+up, down
KINDS = ["xla f32", "native f32", "int8", "int4 g32", "int4 g32 x q8", "w8a8"]

CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from paged_jax import native
from paged_jax.weights import DenseLinear
from paged_jax.weights.methods.on_load import quantize_weight
from paged_jax.weights.panels import to_panels
rows, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
assert native.available(), native.status()
rng = np.random.default_rng(0)
layers = {}
for kind in %(kinds)r:
    ws = []
    for K, N in %(shapes)r:
        w = DenseLinear(jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * 0.05))
        if kind == "native f32":
            w = to_panels({"w": w}, int8=True)["w"]
        elif kind != "xla f32":
            method = {"int8": "int8", "int4 g32": "int4", "int4 g32 x q8": "int4", "w8a8": "w8a8"}[kind]
            w = to_panels({"w": quantize_weight(w, method)}, int8=True, int4_int8=kind == "int4 g32 x q8")["w"]
        ws.append(w)
    layers[kind] = ws
out = {}
for M in rows:  # the kinds interleaved in every repeat, so that a change in the machine's load falls on all
    fs = {}
    for kind, ws in layers.items():
        xs = [jnp.asarray(rng.standard_normal((M, w.in_features)).astype(np.float32)) for w in ws]
        f = jax.jit(lambda ws, xs: [w(x) for w, x in zip(ws, xs)])
        jax.block_until_ready(f(ws, xs))
        fs[kind] = (f, ws, xs)
    for _ in range(repeats):
        for kind, (f, ws, xs) in fs.items():
            t0 = time.perf_counter()
            for _ in range(20):
                r = f(ws, xs)
            jax.block_until_ready(r)
            key = f"{kind}|{M}"
            out[key] = min(out.get(key, float("inf")), (time.perf_counter() - t0) / 20 * 1e6)
print(json.dumps({"times": out, "paths": native.paths()}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the builds in turn, the fastest kept")
    ap.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    best, paths = {}, {}
    with tempfile.TemporaryDirectory() as home:
        for _ in range(a.rounds):
            for name in a.builds:
                flags, xla_isa = BUILDS[name]
                xla_flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), xla_isa and f"--xla_cpu_max_isa={xla_isa}"]))
                env = dict(os.environ, PAGED_JAX_NATIVE_FLAGS=flags, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags,
                           PAGED_JAX_HOME=os.environ.get("PAGED_JAX_HOME") or home,
                           PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
                code = CHILD % {"kinds": KINDS, "shapes": SHAPES}
                res = subprocess.run([sys.executable, "-c", code, json.dumps(a.rows), str(a.repeats)], env=env,
                                     capture_output=True, text=True, cwd=root)
                if res.returncode:
                    sys.exit(res.stderr[-3000:])
                out = json.loads(res.stdout.strip().splitlines()[-1])
                paths[name] = out["paths"]
                for key, t in out["times"].items():
                    best[name, key] = min(best.get((name, key), float("inf")), t)
    print(f"CPU: {open('/proc/cpuinfo').read().split('model name')[1].split(chr(10))[0].strip(': ')}")
    print(f"layer matmuls of a LLaMA 512 wide (intermediate 1408), microseconds per call (/ XLA float32 dot)")
    for name in a.builds:
        print(f"\n{name} build: {paths[name]}")
        print(f"{'rows':>5s} " + " ".join(f"{k:>18s}" for k in KINDS))
        for M in a.rows:
            base = best[name, f"xla f32|{M}"]
            print(f"{M:5d} " + " ".join(f"{best[name, f'{k}|{M}']:9.1f} ({base / best[name, f'{k}|{M}']:4.2f}x)"
                                         for k in KINDS))


if __name__ == "__main__":
    main()
