"""Does the native float32 matmul run at the memory bandwidth at one row? Side by side in one run.

    python experiments/bench_matmul_bandwidth.py [--repeats 7]

The layer weights of ``bench_llamacpp.py``'s LLaMA (512 wide, intermediate 1,408, 8 layers: 103 MB
of float32, every layer its own, so nothing stays in cache), packed as panels: one row of input
through all 32 matmuls in one jitted call (``native.linear``), against the native reader
(``native.read_sum``, the same prefetching and thread sharing) summing the same panels, one call per
weight and over one concatenated array. Prints milliseconds and GB/s (the fastest of ``--repeats``
rounds of 10 calls, the three interleaved in every round).
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax import native

    assert native.available(), native.status()
    rng = np.random.default_rng(0)
    shapes = [(512, 1536), (512, 512), (512, 2816), (1408, 512)] * 8  # q/k/v, o, gate+up, down; 8 layers
    ws = [native.pack_weight(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))) for k, n in shapes]
    xs = [jnp.asarray(rng.standard_normal((1, k)).astype(np.float32)) for k, _ in shapes]
    flat = jnp.concatenate([w.reshape(-1) for w in ws])
    nbytes = sum(w.size * 4 for w in ws)
    cases = {"matmul, 1 row": (jax.jit(lambda ws, xs: [native.linear(x, w) for w, x in zip(ws, xs)]), (ws, xs)),
             "read_sum per weight": (jax.jit(lambda ws: sum(native.read_sum(w) for w in ws)), (ws,)),
             "read_sum, one array": (jax.jit(native.read_sum), (flat,))}
    for f, args in cases.values():
        jax.block_until_ready(f(*args))
    best = {}
    for _ in range(a.repeats):
        for name, (f, args) in cases.items():
            t = time.perf_counter()
            for _ in range(10):
                r = f(*args)
            jax.block_until_ready(r)
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t) / 10)
    print(f"paths: {native.paths()}; {nbytes / 1e6:.0f} MB of float32 panels")
    for name, t in best.items():
        print(f"{name:22s} {t * 1e3:7.3f} ms  {nbytes / t / 1e9:6.1f} GB/s")
    print(f"matmul / fastest reader: {min(best['read_sum per weight'], best['read_sum, one array']) / best['matmul, 1 row']:.2f}x")


if __name__ == "__main__":
    main()
