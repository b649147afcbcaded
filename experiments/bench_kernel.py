"""Paged against contiguous decode attention: the setting of the paper's Fig. 18a.

One decode step of one attention layer (default: LLaMA/OPT-13B's 40 heads of 128), batch
8 and 32, every sequence at context 64, 128 and 256, block size 16. The paged K/V of each
sequence live in randomly permuted blocks of a pool and are read through the block table;
the contiguous K/V are one ``[batch, context, kv_heads, head_dim]`` array per layer (what
FasterTransformer keeps). Prints each variant's time per call (median over repeats, the
variants interleaved so machine noise hits them alike) and ``paged / contiguous``. The paper
measures its paged CUDA kernel 20-26 % slower than FasterTransformer's.

- On a GPU: the Pallas paged decode kernel (``"pallas"``, Triton) against JAX's own Pallas
  contiguous decode kernel (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``; deprecated
  from JAX 0.11, left out with a note where it is gone), and the jnp reference paged path against
  dense XLA attention.
- On the CPU: the jnp reference paged path (a gather through the block table, then attention)
  against dense XLA attention over the contiguous cache; and, for float32, the native CPU
  decode kernel (``paged_jax/native``: reads K/V through the block table, no
  gather) on blocks scattered over the pool against the same kernel on each sequence's
  blocks laid out consecutively (a contiguous cache): what scattering the blocks costs.
  The Pallas kernels run only in interpret mode there, which says nothing about their speed.

    python experiments/bench_kernel.py [--batch 8 32] [--context 64 128 256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention.reference import paged_attention_reference


def contiguous_attention(q, k, v, lens, scale):
    """Dense decode attention: q [S, H, D] over k, v [S, L, KVH, D], keys < lens[s]."""
    S, H, D = q.shape
    KVH = k.shape[2]
    qg = q.reshape(S, KVH, H // KVH, D)
    s = jnp.einsum("skgd,slkd->skgl", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(jnp.arange(k.shape[1])[None, None, None, :] < lens[:, None, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("skgl,slkd->skgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(S, H, D).astype(q.dtype)


def paged_reference(q, k_pool, v_pool, tables, lens, scale):
    out = paged_attention_reference(q[:, None], k_pool, v_pool, tables, lens, jnp.ones_like(lens), scale)
    return out[:, 0]


def make_inputs(S, L, H, KVH, D, block_size, dtype, seed=0):
    """Contiguous K/V and the same tokens scattered into a paged pool (block 0: the null block)."""
    rng = np.random.default_rng(seed)
    mb = -(-L // block_size)
    k = rng.normal(size=(S, mb * block_size, KVH, D)).astype(np.float32)
    v = rng.normal(size=(S, mb * block_size, KVH, D)).astype(np.float32)
    q = rng.normal(size=(S, H, D)).astype(np.float32)
    tables = (1 + rng.permutation(S * mb)).reshape(S, mb).astype(np.int32)
    k_pool = np.zeros((S * mb + 1, block_size, KVH, D), np.float32)
    v_pool = np.zeros_like(k_pool)
    k_pool[tables.reshape(-1)] = k.reshape(S * mb, block_size, KVH, D)
    v_pool[tables.reshape(-1)] = v.reshape(S * mb, block_size, KVH, D)
    dt = jnp.dtype(dtype)
    put = lambda x: jnp.asarray(x, dt)
    # The same tokens with each sequence's blocks consecutive, in order: a contiguous cache
    # addressed through a (trivial) block table.
    seq_tables = (1 + np.arange(S * mb)).reshape(S, mb).astype(np.int32)
    k_seq = np.concatenate([k_pool[:1], k.reshape(S * mb, block_size, KVH, D)])
    v_seq = np.concatenate([v_pool[:1], v.reshape(S * mb, block_size, KVH, D)])
    return dict(q=put(q), k=put(k[:, :L]), v=put(v[:, :L]), k_pool=put(k_pool), v_pool=put(v_pool),
                tables=jnp.asarray(tables), lens=jnp.full((S,), L, jnp.int32), k_seq=put(k_seq), v_seq=put(v_seq),
                seq_tables=jnp.asarray(seq_tables))


def jax_contiguous_decode_kernel():
    """JAX's own Pallas contiguous decode kernel module (``jax.experimental.pallas.ops.gpu.decode_attention``),
    or None when this JAX has none. It is the GPU baseline of the paged kernel, but JAX deprecates it from
    0.11 (a DeprecationWarning on import) and may remove it: then the benchmark says so and times the
    paged kernel without its contiguous counterpart."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # reported once below, not on every import
            from jax.experimental.pallas.ops.gpu import decode_attention
    except ImportError as e:
        print(f"# contiguous Pallas kernel: not available in JAX {jax.__version__} ({e}); "
              "the paged Pallas kernel is timed without it")
        return None
    print(f"# contiguous Pallas kernel: jax.experimental.pallas.ops.gpu.decode_attention.gqa "
          f"(JAX {jax.__version__}; deprecated from JAX 0.11)")
    return decode_attention


def variants(on_gpu: bool, scale: float, dtype: str):
    """(name -> (jitted fn, which inputs), [(paged name, contiguous name)] to compare)."""
    v = {
        "paged jnp reference": (jax.jit(functools.partial(paged_reference, scale=scale)),
                                ("q", "k_pool", "v_pool", "tables", "lens")),
        "contiguous XLA dense": (jax.jit(functools.partial(contiguous_attention, scale=scale)),
                                 ("q", "k", "v", "lens")),
    }
    if on_gpu:
        from paged_jax.attention import AttentionMetadata, AttentionSpec
        from pallas_kernels.backend import PALLAS

        def pallas_paged(q, k_pool, v_pool, tables, lens):
            meta = AttentionMetadata(slot_mapping=None, token_seq=None, block_tables=tables,
                                     context_lens=lens, query_lens=jnp.ones_like(lens))
            return PALLAS.decode(q, k_pool, v_pool, meta, AttentionSpec(scale))

        v["paged Pallas kernel"] = (jax.jit(pallas_paged), ("q", "k_pool", "v_pool", "tables", "lens"))
        pairs = [("paged jnp reference", "contiguous XLA dense")]
        decode_attention = jax_contiguous_decode_kernel()
        if decode_attention is not None:
            def pallas_contiguous(q, k, v, lens):
                L = k.shape[1]
                splits = max(1, min(16, L // 16))
                return decode_attention.gqa(q, k, v, kv_seq_len=lens, sm_scale=scale, k_splits=splits,
                                            block_k=min(128, L // splits))

            v["contiguous Pallas kernel"] = (jax.jit(pallas_contiguous), ("q", "k", "v", "lens"))
            pairs.append(("paged Pallas kernel", "contiguous Pallas kernel"))
        return v, pairs
    pairs = [("paged jnp reference", "contiguous XLA dense")]
    from paged_jax import native

    if dtype == "float32" and native.available():
        fn = jax.jit(functools.partial(native.paged_decode, scale=scale))
        v["paged native CPU kernel"] = (fn, ("q", "k_pool", "v_pool", "tables", "lens"))
        v["contiguous native CPU kernel"] = (fn, ("q", "k_seq", "v_seq", "seq_tables", "lens"))
        pairs.append(("paged native CPU kernel", "contiguous native CPU kernel"))
    return v, pairs


def bench(fns, inputs, iters: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each variant, interleaved across repeats."""
    args = {name: [inputs[a] for a in names] for name, (_, names) in fns.items()}
    for name, (fn, _) in fns.items():
        jax.block_until_ready(fn(*args[name]))  # compile
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, _) in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                out = fn(*args[name])
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / iters * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The device's measured copy bandwidth, bytes read plus written per second (best of ``repeats``):
    a jitted elementwise op over an array of ``nbytes`` (1 GiB; 64 MiB on a CPU), the ceiling a
    memory-bound kernel's bandwidth is read against."""
    if jax.default_backend() == "cpu":
        nbytes = min(nbytes, 64 << 20)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    double = jax.jit(lambda a: a * 2)
    jax.block_until_ready(double(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(double(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def kv_bytes(S: int, L: int, KVH: int, D: int, dtype: str) -> int:
    """The bytes of K and V one decode call must read (every sequence's context, once)."""
    return 2 * S * L * KVH * D * jnp.dtype(dtype).itemsize


def check_equal(fns, inputs, dtype):
    # At full float32 matmul precision: a GPU's default for float32 XLA matmuls is TF32 (errors ~1e-3),
    # which the float32 tolerance would flag although no variant is wrong. The timings run at the default.
    with jax.default_matmul_precision("highest"):
        outs = [np.asarray(fn(*[inputs[a] for a in names]).astype(jnp.float32)) for fn, names in fns.values()]
    tol = 1e-4 if dtype == "float32" else 3e-2
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=tol, rtol=tol)


def _figure(x: float) -> str:
    """One decimal, or three significant digits below 1 (a tiny CPU problem's 0.04 GB/s is not 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--num-heads", type=int, default=40)
    p.add_argument("--num-kv-heads", type=int, default=None, help="default: num_heads (MHA, as in the paper)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, help="default: float16 on a GPU, float32 on the CPU")
    p.add_argument("--iters", type=int, default=None, help="calls per timing (default: 100 GPU, 10 CPU)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    dtype = a.dtype or ("float16" if on_gpu else "float32")
    iters = a.iters or (100 if on_gpu else 10)
    H, D = a.num_heads, a.head_dim
    KVH = a.num_kv_heads or H
    fns, pairs = variants(on_gpu, D ** -0.5, dtype)
    names = list(fns)
    print(f"# decode attention, one layer: {H} heads ({KVH} KV heads) x {D}, block size {a.block_size}, {dtype}, "
          f"{jax.devices()[0].device_kind} ({jax.default_backend()}); median of {a.repeats} x {iters} calls, us")
    copy_bw = copy_bandwidth()
    kernel = pairs[-1][0]  # the paged kernel of the platform (Pallas on a GPU, native on a CPU)
    print(f"# device copy bandwidth (read + written): {copy_bw / 1e9:.1f} GB/s; '{kernel}' reads K/V at the "
          "GB/s below, and that as a fraction of the copy bandwidth")
    header = "batch context " + " ".join(f"{n:>24s}" for n in names)
    header += " " + " ".join(f"{'ratio ' + pn.split()[1]:>18s}" for pn, _ in pairs)
    header += f" {'K/V GB/s':>10s} {'of copy':>8s}"
    print(header)
    for S in a.batch:
        for L in a.context:
            inputs = make_inputs(S, L, H, KVH, D, a.block_size, dtype)
            check_equal(fns, inputs, dtype)
            t = bench(fns, inputs, iters, a.repeats)
            row = f"{S:5d} {L:7d} " + " ".join(f"{t[n]:24.1f}" for n in names)
            row += " " + " ".join(f"{t[pn] / t[cn]:18.2f}" for pn, cn in pairs)
            bw = kv_bytes(S, L, KVH, D, dtype) / (t[kernel] * 1e-6)
            row += f" {_figure(bw / 1e9):>10s} {_figure(100 * bw / copy_bw):>7s}%"
            print(row, flush=True)
    print("# ratio = paged / contiguous time (the paper: its paged kernel is 1.20-1.26x FasterTransformer's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
