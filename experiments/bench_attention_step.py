"""One layer's attention over one ragged step, by backend path, side by side in one process.

    python experiments/bench_attention_step.py [--heads 8] [--kv-heads 8] [--head-dim 64] [--repeats 5]
                                               [--block-chunk-contexts 4000 16000] [--backends native ...]
                                               [--decode-batch 48] [--decode-contexts 150]

Steps, each through ``paged_attention_layer`` (the cache write included, the caches donated as the
engine's step donates them), jitted, the best of ``--repeats`` timings of 10 calls kept:

- *short prompts*: four whole prompts of 60-70 tokens (a 256-token bucket), as the prefill of many
  short requests runs;
- *long chunk*: 16 decodes (contexts of 41) beside a 240-token chunk ending at a 4,000-token context,
  as a long prompt's late chunk runs under chunked prefill;
- *one block at N*: 16 decodes (contexts of 300) beside a one-block chunk ending at an N-token
  context (``--block-chunk-contexts``): a latency target's smallest whole-block chunk late in a long prompt;
- *B decodes at N*: a decode step alone, ``--decode-batch`` rows each over an N-token context
  (``--decode-contexts``, default 150: the 48 requests of ``bench_llamacpp.py`` halfway through their
  output), as continuous batching's decode steps run: its K/V GB/s against the machine's read
  bandwidth (``experiments/roofline.py``) says how far the decode is from the memory's floor;
- *Q queries at N*: the same with a chunk of Q tokens (``--few-queries``, default 4): a chunk the target
  cuts below a block when not even a block fits (fewer queries than the kernel's register tiles hold).

Also printed: the first path's GFLOP/s (4 FLOP per query, key and head dimension) and K/V GB/s (each
row's context read once).

Paths: ``native`` (the ``"auto"`` choice on a CPU: the ragged kernel takes the whole step),
``tiles`` (the native decode kernel plus the query tiles through the reference's blockwise jnp
prefill: what ``"auto"`` ran before the kernel took whole steps) and ``reference`` (plain jnp).
"""

from __future__ import annotations

import argparse
import time

import bench_common  # noqa: F401  (puts this checkout on the path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-chunk-contexts", type=int, nargs="*", default=[4000, 16000],
                    help="also 16 decodes beside a one-block chunk ending at each of these contexts")
    ap.add_argument("--few-queries", type=int, nargs="*", default=[4],
                    help="also 16 decodes beside a chunk of this many tokens at each of those contexts")
    ap.add_argument("--backends", nargs="+", default=["native", "tiles", "reference"])
    ap.add_argument("--decode-batch", type=int, default=48, help="rows of the decode-only steps")
    ap.add_argument("--decode-contexts", type=int, nargs="*", default=[150],
                    help="a decode-only step of --decode-batch rows at each of these contexts")
    a = ap.parse_args(argv)
    if a.decode_batch < 1 or any(c < 1 for c in a.decode_contexts):
        ap.error(f"--decode-batch and --decode-contexts must be >= 1, got {a.decode_batch} and {a.decode_contexts}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax import native
    from paged_jax.attention import REFERENCE, AttentionSpec, NativeBackend, get_backend, paged_attention_layer
    from paged_jax.executor.batch import SeqChunk, prepare_batch

    class Tiles(NativeBackend):
        """The kernel on decode rows and the blockwise jnp on query tiles (the split step)."""
        name = "tiles"
        ragged = None

        def decode(self, q, k_cache, v_cache, meta, spec):
            return native.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, spec.scale)

        def prefill(self, q, k_cache, v_cache, meta, spec):
            return REFERENCE.prefill(q, k_cache, v_cache, meta, spec)

    if not native.available():
        raise SystemExit(f"the native kernels are not available here: {native.status()}")
    H, KVH, D, bs = a.heads, a.kv_heads, a.head_dim, a.block_size
    spec = AttentionSpec(scale=D ** -0.5)
    rng = np.random.default_rng(0)

    def step(kinds):
        chunks, nb = [], 1
        for n, ctx in kinds:
            blocks = -(-ctx // bs)
            chunks.append(SeqChunk(list(range(n)), ctx - n, list(range(nb, nb + blocks))))
            nb += blocks
        return prepare_batch(chunks, bs), nb

    steps = {"short prompts": [(60, 60), (70, 70), (64, 64), (62, 62)],
             "long chunk": [(1, 41)] * 16 + [(240, 4000)]}
    for ctx in a.decode_contexts:  # continuous batching's decode step
        steps[f"{a.decode_batch} decodes at {ctx:,}"] = [(1, ctx)] * a.decode_batch
    for ctx in a.block_chunk_contexts:  # a latency target's smallest chunk late in a long prompt
        steps[f"one block at {ctx:,}"] = [(1, 300)] * 16 + [(bs, ctx)]
        for n in a.few_queries:
            steps[f"{n} queries at {ctx:,}"] = [(1, 300)] * 16 + [(n, ctx)]
    backends = {"native": get_backend("native"), "tiles": Tiles(), "reference": get_backend("reference")}
    backends = {name: backends[name] for name in a.backends}
    print(f"one layer: {H} heads ({KVH} KV heads) of {D}, blocks of {bs}, float32; ms per call, best of "
          f"{a.repeats} x 10 calls")
    print("| step | " + " | ".join(backends) + " | tiles / native | GFLOP/s | K/V GB/s |")
    print("|---|" + "---:|" * (len(backends) + 3))
    for name, kinds in steps.items():
        batch, nb = step(kinds)
        T = batch.input_ids.shape[0]
        # The step's work, for the rates of the first path: 4 FLOP per query, key and head dimension
        # (QK^T and PV; each query over its causal keys) and the K and V bytes of every row's context
        # read once (a kernel reading the context once per tile of queries reads a long chunk's more often).
        flop = sum(4 * H * D * (n * (ctx - n) + n * (n + 1) // 2) for n, ctx in kinds)
        kv_bytes = sum(2 * ctx * KVH * D * 4 for _, ctx in kinds)
        q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
        kv = jnp.asarray(rng.standard_normal((T, KVH, D)), jnp.float32)
        cache = jnp.asarray(rng.standard_normal((nb + 4, bs, KVH, D)), jnp.float32)
        meta = jax.tree.map(jnp.asarray, batch)
        ms = {}
        for bname, backend in backends.items():
            # The caches are donated, as the engine's step donates them: otherwise each call copies
            # them whole (for a 16k context, more than the attention itself costs).
            fn = jax.jit(lambda q, kv, kc, vc, m, b=backend: paged_attention_layer(q, kv, kv, (kc, vc), meta=m, spec=spec,
                                                                                    backend=b), donate_argnums=(2, 3))
            caches = (cache + 0, cache + 0)
            out, caches = fn(q, kv, *caches, meta)
            out.block_until_ready()
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                for _ in range(10):
                    out, caches = fn(q, kv, *caches, meta)
                out.block_until_ready()
                best = min(best, (time.perf_counter() - t) / 10 * 1e3)
            ms[bname] = best
        print(f"| {name} (T={T}) | " + " | ".join(f"{v:.2f}" for v in ms.values()) +
              (f" | {ms['tiles'] / ms['native']:.2f}x |" if {"tiles", "native"} <= ms.keys() else " | - |") +
              f" {flop / next(iter(ms.values())) / 1e6:.0f} | {kv_bytes / next(iter(ms.values())) / 1e6:.1f} |")


if __name__ == "__main__":
    main()
