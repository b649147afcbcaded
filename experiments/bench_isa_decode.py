"""Decode tokens/s of float32, int8, int4 and W8A8 weights, per instruction set the native kernels
are built for, side by side in one run.

    python experiments/bench_isa_decode.py [--batches 1 8] [--tokens 32] [--repeats 3] [--rounds 2]

The model of ``bench_quantized.py`` (a LLaMA 512 wide, 8 layers, vocabulary 4,096, random, made
here), loaded as float32 (its weights packed into panels for the native matmul, "f32 panels", and
left to XLA's matmul, "f32 XLA") and quantized on load (``quantization="int8" | "int4" |
"w8a8"``). Each
build runs in its own process (the kernels' paths are fixed when the library is compiled; XLA's
generated code is held to the same set with ``--xla_cpu_max_isa``): the default ``-march=native``,
and ``-mno-avx512f`` (AVX2 + FMA3; on an AVX-512 machine that machine with AVX-512 turned off, not
an AVX2 CPU: XLA's float32 dots still run YNNPACK's AVX-512 kernels there, see
``bench_matmul_isa.py``, so "f32 XLA" is faster in those rows than on an AVX2 CPU). The builds alternate for ``--rounds`` rounds, the formats interleave within each
(``bench_quantized.decode_seconds``), and the fastest is kept. Prints tokens/s at each batch size
with each format's ratio to the float32 the engine runs in that build (``native.packs_weights()``
says which of the two), and which float32 is the faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BUILDS = {"native": ("", None), "AVX-512 off (AVX2)": ("-mno-avx512f", "AVX2")}
# name: quantization on load; float32 weights packed into panels for the native matmul, or left to XLA's
FORMATS = {"f32 panels": None, "f32 XLA": None, "int8": "int8", "int4": "int4", "w8a8": "w8a8"}

CHILD = r"""
import json, sys
sys.path.insert(0, "experiments")
from bench_quantized import decode_seconds
from paged_jax import LLM, native
model, batches, tokens, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
engines = {}
engine_packs = native.packs_weights()  # the engine's own choice for float32 weights
for name, q in %(formats)r.items():
    native.packs_weights = lambda: name == "f32 panels"  # prepare() asks it as the engine loads
    engines[name] = LLM(model, quantization=q, max_model_len=256, num_kv_blocks=max(batches) * (16 + tokens) // 16 + 8)
    for b in batches:
        decode_seconds(engines[name], b, tokens)  # compiles the shapes the cell reaches
rates = {}
for b in batches:
    for _ in range(repeats):
        for name, llm in engines.items():
            key = f"{name}|{b}"
            rates[key] = max(rates.get(key, 0), b * tokens / decode_seconds(llm, b, tokens))
print(json.dumps({"rates": rates, "paths": native.paths(), "packs": engine_packs}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from paged_jax.models.tiny import make_tiny_model

    best, paths = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(os.path.join(tmp, "float"), family="llama", vocab_size=4096, hidden_size=512,
                                    intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                                    num_key_value_heads=8))
        for _ in range(a.rounds):
            for name, (flags, xla_isa) in BUILDS.items():
                xla_flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), xla_isa and f"--xla_cpu_max_isa={xla_isa}"]))
                env = dict(os.environ, PAGED_JAX_NATIVE_FLAGS=flags, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags,
                           PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
                res = subprocess.run([sys.executable, "-c", CHILD % {"formats": FORMATS}, model, json.dumps(a.batches),
                                      str(a.tokens), str(a.repeats)], env=env, capture_output=True, text=True, cwd=root)
                if res.returncode:
                    sys.exit(res.stderr[-3000:])
                out = json.loads(res.stdout.strip().splitlines()[-1])
                paths[name] = out["paths"], out["packs"]
                for key, r in out["rates"].items():
                    best[name, key] = max(best.get((name, key), 0), r)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; decode tokens/s (/ the float32 the engine runs in that build), {a.tokens} tokens out, "
          "16-token prompts")
    print(f"{'build':20s} {'weights':10s} " + " ".join(f"{'batch ' + str(b):>16s}" for b in a.batches))
    for name in BUILDS:
        base = "f32 panels" if paths[name][1] else "f32 XLA"
        for fmt in FORMATS:
            print(f"{name:20s} {fmt:10s} " + " ".join(
                f"{best[name, f'{fmt}|{b}']:8.1f} ({best[name, f'{fmt}|{b}'] / best[name, f'{base}|{b}']:4.2f}x)"
                for b in a.batches))
    for name in BUILDS:
        print(f"{name}: {paths[name][0]}; the engine runs float32 as \"{'f32 panels' if paths[name][1] else 'f32 XLA'}\"")


if __name__ == "__main__":
    main()
