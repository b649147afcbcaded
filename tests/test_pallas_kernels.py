"""The Pallas paged-attention decode kernel against the jnp reference (interpret mode on CPU),
its lowering for CUDA (Triton backend), and the "pallas" backend in a tiny model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import get_backend
from paged_jax.attention.reference import paged_attention_reference
from pallas_kernels.paged_attention import (
    _auto_partition,
    paged_attention_pallas,
    paged_decode_attention,
    register,
)

GARBAGE = 1e4  # stale values in unused blocks and slots (finite; fits float16)
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}


def make_case(seed, *, lens, H, KVH, D, block_size, max_blocks, num_blocks, dtype="float32", stale_tables=False):
    """Random q and a page pool full of garbage, with each sequence's tokens written
    into distinct, randomly permuted blocks. Returns numpy arrays."""
    rng = np.random.default_rng(seed)
    S = len(lens)
    k = rng.uniform(-GARBAGE, GARBAGE, size=(num_blocks, block_size, KVH, D)).astype(np.float32)
    v = rng.uniform(-GARBAGE, GARBAGE, size=(num_blocks, block_size, KVH, D)).astype(np.float32)
    q = rng.normal(size=(S, H, D)).astype(np.float32)
    needed = [-(-n // block_size) for n in lens]
    assert max(needed) <= max_blocks and sum(needed) <= num_blocks - 1, "pool too small for the case"
    pool = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((S, max_blocks), np.int32)  # 0 = null block past the end
    for s, n in enumerate(lens):
        for j in range(needed[s]):
            b = pool.pop()
            tables[s, j] = b
            valid = min(block_size, n - j * block_size)
            k[b, :valid] = rng.normal(size=(valid, KVH, D))
            v[b, :valid] = rng.normal(size=(valid, KVH, D))
        if stale_tables:  # entries past the end point at other (garbage) blocks
            tables[s, needed[s]:] = rng.integers(0, num_blocks, size=max_blocks - needed[s])
    dt = jnp.dtype(dtype)
    return (np.asarray(jnp.asarray(q, dt)), np.asarray(jnp.asarray(k, dt)), np.asarray(jnp.asarray(v, dt)),
            tables, np.asarray(lens, np.int32))


def reference_f32(q, k, v, tables, lens, scale):
    """paged_attention_reference with Q == 1, computed in float32 on the (rounded) inputs."""
    f = lambda x: jnp.asarray(x, jnp.float32)
    out = paged_attention_reference(f(q)[:, None], f(k), f(v), jnp.asarray(tables), jnp.asarray(lens),
                                    jnp.ones(len(lens), jnp.int32), scale)
    return np.asarray(out[:, 0])


@functools.lru_cache(maxsize=None)
def jitted_kernel(partition_size):
    return jax.jit(functools.partial(paged_decode_attention, partition_size=partition_size))


def run_kernel(q, k, v, tables, lens, scale, partition_size=None):
    f = jitted_kernel(partition_size)
    return np.asarray(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lens),
                        scale).astype(jnp.float32))


def check(case, scale, partition_size, dtype):
    q, k, v, tables, lens = case
    got = run_kernel(q, k, v, tables, lens, scale, partition_size)
    assert np.isfinite(got).all(), "padded or empty rows must not produce NaN/inf"
    want = reference_f32(q, k, v, tables, lens, scale)
    real = lens > 0
    np.testing.assert_allclose(got[real], want[real], atol=TOL[dtype], rtol=TOL[dtype])


# (name, lens, H, KVH, D, block_size, max_blocks, num_blocks): lengths 1, mid-block,
# exactly on a block boundary, the maximum, and 0 (a padded row).
CASES = [
    ("gqa_d64_bs16", [1, 23, 32, 64, 0], 4, 2, 64, 16, 4, 16),
    ("mqa_d128_bs8", [8, 1, 13, 40], 4, 1, 128, 8, 5, 20),
    ("gqa_d32_bs32", [64, 31, 1], 8, 2, 32, 32, 2, 8),
    ("mha_d16_bs8", [17, 24, 2, 0], 2, 2, 16, 8, 3, 12),
    ("gqa3_d16_bs16", [48, 5], 6, 2, 16, 16, 3, 8),  # G = 3 (padded to 16 rows)
    ("one_block_bs8", [3, 8], 2, 1, 16, 8, 1, 4),  # table narrower than one 16-token chunk
]


@pytest.mark.parametrize("partition_size", [None, 16], ids=["single", "split16"])
@pytest.mark.parametrize("name,lens,H,KVH,D,block_size,max_blocks,num_blocks", CASES, ids=[c[0] for c in CASES])
def test_decode_float32_matches_reference(name, lens, H, KVH, D, block_size, max_blocks, num_blocks, partition_size):
    if partition_size is not None and partition_size % block_size:
        partition_size = block_size  # block 32: partitions of one block
    case = make_case(sum(map(ord, name)), lens=lens, H=H, KVH=KVH, D=D, block_size=block_size,
                     max_blocks=max_blocks, num_blocks=num_blocks, stale_tables=name.startswith("mqa"))
    check(case, D ** -0.5, partition_size, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("partition_size", [None, 32], ids=["single", "split32"])
def test_decode_half_precision(dtype, partition_size):
    case = make_case(7, lens=[1, 45, 16, 64, 0], H=8, KVH=2, D=64, block_size=16, max_blocks=4, num_blocks=16,
                     dtype=dtype)
    check(case, 0.125, partition_size, dtype)


def test_random_shapes_and_lengths():
    """A seeded sweep over shapes, split sizes and ragged lengths (few distinct shapes: each compiles)."""
    rng = np.random.default_rng(0)
    for trial in range(3):
        block_size = int(rng.choice([8, 16, 32]))
        D = int(rng.choice([16, 32, 64]))
        KVH = int(rng.choice([1, 2]))
        H = KVH * int(rng.choice([1, 2, 4]))
        max_blocks = int(rng.integers(2, 6))
        S = int(rng.integers(1, 5))
        lens = list(rng.integers(0, max_blocks * block_size + 1, size=S))
        lens[0] = max_blocks * block_size
        part = [None, max(16, block_size) * int(rng.integers(1, 3))][trial % 2]
        case = make_case(trial, lens=lens, H=H, KVH=KVH, D=D, block_size=block_size, max_blocks=max_blocks,
                         num_blocks=S * max_blocks + 2)
        check(case, float(rng.uniform(0.05, 0.5)), part, "float32")


def test_traced_scale_and_zero_rows():
    """scale may be a traced value; an all-padding batch gives zeros, not NaN."""
    q, k, v, tables, lens = make_case(3, lens=[0, 0], H=2, KVH=1, D=16, block_size=16, max_blocks=2, num_blocks=4)
    f = jax.jit(lambda *a: paged_decode_attention(*a, partition_size=16))
    out = np.asarray(f(q, k, v, tables, lens, jnp.float32(0.25)))
    assert np.array_equal(out, np.zeros_like(out))


def test_rejects_unsupported_shapes():
    q, k, v, tables, lens = make_case(0, lens=[3], H=2, KVH=1, D=16, block_size=8, max_blocks=2, num_blocks=4)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention(q, k, v, tables, lens, 1.0, partition_size=8)  # 8-token chunks: under tl.dot's 16
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :1].repeat(3, 1), k.repeat(2, 2), v.repeat(2, 2), tables, lens, 1.0)


# ---- the backend -------------------------------------------------------------------------------


def test_backend_registers_and_dispatches_statically():
    register()
    assert get_backend("pallas") is paged_attention_pallas
    q, k, v, tables, lens = make_case(1, lens=[5, 12], H=4, KVH=2, D=16, block_size=8, max_blocks=2, num_blocks=6)
    qlens = np.ones(2, np.int32)
    decode = jax.make_jaxpr(paged_attention_pallas, static_argnums=6)(q[:, None], k, v, tables, lens, qlens, 0.25)
    assert "pallas_call" in str(decode)
    out = jax.jit(paged_attention_pallas, static_argnums=6)(q[:, None], k, v, tables, lens, qlens, 0.25)
    np.testing.assert_allclose(np.asarray(out[:, 0]), reference_f32(q, k, v, tables, lens, 0.25), atol=1e-5)
    # Q > 1 (prefill): the reference, exactly.
    q3 = np.repeat(q[:, None], 3, axis=1)
    qlens3 = np.array([3, 2], np.int32)
    prefill = jax.make_jaxpr(paged_attention_pallas, static_argnums=6)(q3, k, v, tables, lens, qlens3, 0.25)
    assert "pallas_call" not in str(prefill)
    np.testing.assert_array_equal(np.asarray(paged_attention_pallas(q3, k, v, tables, lens, qlens3, 0.25)),
                                  np.asarray(paged_attention_reference(q3, k, v, tables, lens, qlens3, 0.25)))


def test_backend_splits_long_contexts():
    assert _auto_partition(S=2, H=4, max_context=512) is None
    assert _auto_partition(S=2, H=4, max_context=528) == 512
    assert _auto_partition(S=256, H=4, max_context=4096) is None  # big batch: no split
    # A 528-token context through the backend (two partitions; blocks shared across rows, as with prefixes).
    rng = np.random.default_rng(5)
    bs, mb, nb = 16, 33, 24
    k = jnp.asarray(rng.normal(size=(nb, bs, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(nb, bs, 1, 16)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 1, 2, 16)), jnp.float32)
    tables = jnp.asarray(rng.integers(1, nb, size=(2, mb)), jnp.int32)
    lens = jnp.asarray([528, 515], jnp.int32)
    qlens = jnp.ones(2, jnp.int32)
    jaxpr = str(jax.make_jaxpr(paged_attention_pallas, static_argnums=6)(q, k, v, tables, lens, qlens, 0.25))
    assert "f32[2,1,2,16,16]" in jaxpr  # partial outputs [S, KVH, partitions, Gp, D]
    got = jax.jit(paged_attention_pallas, static_argnums=6)(q, k, v, tables, lens, qlens, 0.25)
    want = paged_attention_reference(q, k, v, tables, lens, qlens, 0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ---- lowering for CUDA from the CPU-only jaxlib ------------------------------------------------------


@pytest.mark.parametrize("dtype,D,block_size,partition_size", [
    ("float32", 64, 16, None), ("bfloat16", 128, 8, 32), ("float16", 128, 32, 64), ("bfloat16", 64, 16, 512)])
def test_lowers_for_cuda_with_triton(dtype, D, block_size, partition_size):
    S, H, KVH, nb, mb = 8, 32, 8, 64, 48
    dt = jnp.dtype(dtype)
    args = (jax.ShapeDtypeStruct((S, H, D), dt), jax.ShapeDtypeStruct((nb, block_size, KVH, D), dt),
            jax.ShapeDtypeStruct((nb, block_size, KVH, D), dt), jax.ShapeDtypeStruct((S, mb), jnp.int32),
            jax.ShapeDtypeStruct((S,), jnp.int32), 0.125)
    f = functools.partial(paged_decode_attention, partition_size=partition_size, interpret=False)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (jax.default_backend() != 'gpu')")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("partition_size", [None, 64])
def test_compiled_on_gpu_matches_reference(dtype, partition_size):
    case = make_case(11, lens=[1, 100, 128, 257, 512, 0], H=32, KVH=8, D=128, block_size=16, max_blocks=32,
                     num_blocks=128, dtype=dtype)
    q, k, v, tables, lens = case
    f = jax.jit(functools.partial(paged_decode_attention, partition_size=partition_size, interpret=False))
    got = np.asarray(f(q, k, v, tables, lens, 128 ** -0.5).astype(jnp.float32))
    assert np.isfinite(got).all()
    want = reference_f32(q, k, v, tables, lens, 128 ** -0.5)
    np.testing.assert_allclose(got[lens > 0], want[lens > 0], atol=TOL[dtype], rtol=TOL[dtype])


# ---- end to end: a tiny Llama (GQA, head_dim 16) with the "pallas" backend ------------------------------


def test_tiny_llama_logits_pallas_vs_reference(tiny_llama_dir):
    from paged_jax.executor.batch import SeqChunk
    from paged_jax.models.loader import load_model
    from tests.model_helpers import PagedRunner

    register()
    config, params = load_model(tiny_llama_dir, dtype="float32")
    runners = {b: PagedRunner(config, params, block_size=4, num_blocks=32, seed=3, backend=b)
               for b in ("reference", "pallas")}
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, config.vocab_size, size=n)) for n in (1, 6, 13)]
    seqs = [list(p) for p in prompts]
    tables = {b: [r.table_for([], len(p)) for p in prompts] for b, r in runners.items()}
    chunks = {b: [SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables[b])] for b in runners}
    for step in range(6):  # one prefill (reference path in both) and five decode steps (the kernel)
        logits = {}
        for b, r in runners.items():
            out, batch = r.run(chunks[b])
            logits[b] = out[batch.logits_indices[: batch.num_seqs]]
        np.testing.assert_allclose(logits["pallas"], logits["reference"], atol=1e-4, rtol=0)
        nxt = logits["reference"].argmax(-1)
        for s, tok in zip(seqs, nxt):
            s.append(int(tok))
        chunks = {b: [SeqChunk([s[-1]], len(s) - 1, runners[b].table_for(t, len(s)))
                      for s, t in zip(seqs, tables[b])] for b in runners}
