"""The Pallas paged-attention kernels (decode and prefill) against the jnp reference (interpret
mode on CPU), their lowering for CUDA (Triton backend), and the "pallas" / "pallas-interpret"
backends in a tiny model and in the engine."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.attention import AttentionMetadata, AttentionSpec, get_backend, select_backend
from paged_jax.attention.reference import paged_attention_reference
from pallas_kernels import cuda_lowering
from pallas_kernels.backend import PALLAS, PALLAS_INTERPRET, _auto_partition
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from tests.slow_cases import slow_unless

GARBAGE = 1e4  # stale values in unused blocks and slots (finite; fits float16)
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}


def make_case(seed, *, lens, H, KVH, D, block_size, max_blocks, num_blocks, dtype="float32", stale_tables=False,
              Q=None):
    """Random q ([S, H, D], or [S, Q, H, D] when Q is given) and a page pool full of garbage,
    with each sequence's tokens written into distinct, randomly permuted blocks. Returns numpy arrays."""
    rng = np.random.default_rng(seed)
    S = len(lens)
    k = rng.uniform(-GARBAGE, GARBAGE, size=(num_blocks, block_size, KVH, D)).astype(np.float32)
    v = rng.uniform(-GARBAGE, GARBAGE, size=(num_blocks, block_size, KVH, D)).astype(np.float32)
    q = rng.normal(size=(S, H, D) if Q is None else (S, Q, H, D)).astype(np.float32)
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
    """paged_attention_reference with Q == 1, computed in float32 on the (rounded) inputs, at full float32
    matmul precision (a GPU's default for float32 is TF32, ~1e-3: above the float32 tolerance)."""
    f = lambda x: jnp.asarray(x, jnp.float32)
    with jax.default_matmul_precision("highest"):
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


# the partitioned decode of every shape: -m slow (by default in test_decode_half_precision and the variants')
@pytest.mark.parametrize("partition_size", slow_unless([pytest.param(None, id="single"), pytest.param(16, id="split16")],
                                                       {None}))
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


# ---- the prefill kernel ----------------------------------------------------------------------------


def reference_prefill_f32(q, k, v, tables, lens, qlens, scale):
    f = lambda x: jnp.asarray(x, jnp.float32)
    with jax.default_matmul_precision("highest"):  # as reference_f32
        return np.asarray(paged_attention_reference(f(q), f(k), f(v), jnp.asarray(tables), jnp.asarray(lens),
                                                    jnp.asarray(qlens), scale))


@functools.lru_cache(maxsize=None)
def jitted_prefill(tile_rows=64, chunk_tokens=64):
    return jax.jit(functools.partial(paged_prefill_attention, tile_rows=tile_rows, chunk_tokens=chunk_tokens,
                                     interpret=True))


def check_prefill(case, qlens, scale, dtype, **kw):
    q, k, v, tables, lens = case
    qlens = np.asarray(qlens, np.int32)
    got = np.asarray(jitted_prefill(**kw)(q, k, v, tables, lens, qlens, scale).astype(jnp.float32))
    assert got.shape == q.shape
    assert np.isfinite(got).all(), "padding rows must not produce NaN/inf"
    assert not got[lens == 0].any(), "padded sequences give zeros"
    want = reference_prefill_f32(q, k, v, tables, lens, qlens, scale)
    for s, n in enumerate(qlens):  # rows i >= query_lens[s] are padding (unspecified)
        np.testing.assert_allclose(got[s, :n], want[s, :n], atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"seq {s}")


# (name, context lens, query lens, Q, H, KVH, D, block_size, max_blocks, num_blocks). Contexts of length 1,
# ending mid-block, exactly on a block boundary and the maximum; queries: a whole prompt, a chunk after a
# cached prefix, a single (decode) query, and a padded sequence (0, 0).
PREFILL_CASES = [
    ("gqa_d64_bs16", [1, 23, 32, 64, 0], [1, 7, 32, 13, 0], 32, 4, 2, 64, 16, 4, 16),
    ("mqa_d128_bs8", [8, 40, 13], [8, 40, 1], 40, 4, 1, 128, 8, 5, 20),
    ("mha_d64_bs32", [64, 31, 33], [64, 31, 2], 64, 2, 2, 64, 32, 2, 8),
    ("gqa3_d16_bs4", [9, 24, 3], [9, 5, 2], 16, 6, 2, 16, 4, 6, 24),  # G = 3 (padded to 4 rows per query)
    ("gqa8_d32_bs1", [17, 4], [3, 4], 4, 8, 1, 32, 1, 24, 48),  # G = 8, one token per block
    ("bs12_d48_interpret", [25, 12, 36], [25, 12, 6], 32, 4, 2, 48, 12, 3, 12),  # non power-of-2 shapes
]


@pytest.mark.parametrize("name,lens,qlens,Q,H,KVH,D,block_size,max_blocks,num_blocks", PREFILL_CASES,
                         ids=[c[0] for c in PREFILL_CASES])
def test_prefill_float32_matches_reference(name, lens, qlens, Q, H, KVH, D, block_size, max_blocks, num_blocks):
    case = make_case(sum(map(ord, name)), lens=lens, H=H, KVH=KVH, D=D, block_size=block_size, Q=Q,
                     max_blocks=max_blocks, num_blocks=num_blocks, stale_tables=name.startswith("mqa"))
    check_prefill(case, qlens, D ** -0.5, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_half_precision(dtype, D):
    case = make_case(8, lens=[1, 45, 16, 64, 0], H=8, KVH=2, D=D, block_size=16, max_blocks=4, num_blocks=16,
                     dtype=dtype, Q=16)
    check_prefill(case, [1, 16, 16, 9, 0], D ** -0.5, dtype)


def test_prefill_small_tiles_and_chunks():
    """Many query tiles per sequence (tiles past query_len run no loop) and 16-token K/V chunks."""
    case = make_case(9, lens=[64, 50, 7], H=4, KVH=2, D=64, block_size=8, max_blocks=8, num_blocks=28, Q=64,
                     stale_tables=True)
    check_prefill(case, [64, 20, 7], 0.125, "float32", tile_rows=16, chunk_tokens=16)


# A few fixed shapes (each compiles once), random lengths, tables and pools drawn by hypothesis.
SHAPES = [  # (H, KVH, D, block_size, max_blocks, S, Q)
    (4, 2, 64, 8, 6, 3, 32),
    (2, 1, 128, 16, 3, 2, 16),
    (8, 8, 64, 32, 2, 4, 64),
]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), shape=st.sampled_from(SHAPES), stale=st.booleans())
def test_prefill_random_lengths_and_tables(data, shape, stale):
    H, KVH, D, bs, mb, S, Q = shape
    L = mb * bs
    kinds = st.sampled_from(["one", "mid", "boundary", "max", "any", "pad"])
    lens, qlens = [], []
    for _ in range(S):
        kind = data.draw(kinds)
        n = {"one": 1, "boundary": bs * data.draw(st.integers(1, mb)), "max": L, "pad": 0}.get(kind)
        if n is None:
            n = data.draw(st.integers(1, L).filter(lambda x: kind == "any" or x % bs))
        lens.append(n)
        qlens.append(0 if n == 0 else data.draw(st.integers(1, min(n, Q))))
    seed = data.draw(st.integers(0, 2 ** 16))
    case = make_case(seed, lens=lens, H=H, KVH=KVH, D=D, block_size=bs, max_blocks=mb, num_blocks=S * mb + 3, Q=Q,
                     stale_tables=stale)
    check_prefill(case, qlens, data.draw(st.sampled_from([D ** -0.5, 0.05])), "float32")


def test_prefill_random_shapes():
    """A seeded sweep over shapes too (dtypes, block sizes, head sizes, group sizes, query widths)."""
    rng = np.random.default_rng(1)
    for trial in range(3):
        bs = int(rng.choice([4, 8, 16, 32]))
        D = int(rng.choice([64, 128]))
        KVH = int(rng.choice([1, 2]))
        H = KVH * int(rng.choice([1, 2, 3, 4]))
        mb = int(rng.integers(1, 5))
        S = int(rng.integers(1, 4))
        Q = int(rng.integers(2, mb * bs + 1))
        lens = [int(x) for x in rng.integers(1, mb * bs + 1, size=S)]
        lens[0] = mb * bs
        qlens = [int(rng.integers(1, min(n, Q) + 1)) for n in lens]
        dtype = ["float32", "bfloat16", "float16"][trial]
        case = make_case(100 + trial, lens=lens, H=H, KVH=KVH, D=D, block_size=bs, max_blocks=mb,
                         num_blocks=S * mb + 2, Q=Q, dtype=dtype, stale_tables=bool(trial % 2))
        check_prefill(case, qlens, D ** -0.5, dtype)


def test_prefill_rejects_bad_shapes():
    q, k, v, tables, lens = make_case(0, lens=[3], H=2, KVH=1, D=48, block_size=8, max_blocks=2, num_blocks=4, Q=4)
    qlens = np.array([3], np.int32)
    with pytest.raises(ValueError, match="head_dim=48 must be a power of 2"):
        paged_prefill_attention(q, k, v, tables, lens, qlens, 1.0, interpret=False)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        paged_prefill_attention(q[:, :, :1].repeat(3, 2), k.repeat(2, 2), v.repeat(2, 2), tables, lens, qlens, 1.0)
    with pytest.raises(ValueError, match="head_dim=32"):
        paged_prefill_attention(q[..., :32], k, v, tables, lens, qlens, 1.0)


# ---- the backends --------------------------------------------------------------------------------


def attention_meta(tables, lens, qlens):
    """The step metadata a backend reads (block tables and lengths; the token maps are the layer's)."""
    return AttentionMetadata(slot_mapping=None, token_seq=None, block_tables=jnp.asarray(tables),
                             context_lens=jnp.asarray(lens), query_lens=jnp.asarray(qlens))


def run_backend(backend, q, k, v, tables, lens, qlens, spec):
    """q [S, Q, H, D] through ``backend``: decode when Q == 1 (as the layer dispatches), else prefill."""
    meta = attention_meta(tables, lens, qlens)
    if q.shape[1] == 1:
        return backend.decode(q[:, 0], k, v, meta, spec)[:, None]
    return backend.prefill(q, k, v, meta, spec)


def test_backends_are_registered_and_pallas_needs_a_gpu():
    assert get_backend("pallas-interpret") is PALLAS_INTERPRET and get_backend("pallas") is PALLAS
    select_backend("pallas-interpret", [AttentionSpec(0.1, sliding_window=8, logit_soft_cap=30.0)], "float16")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a CUDA GPU.*'pallas-interpret'.*'reference'"):
            select_backend("pallas", [AttentionSpec(0.1)], "bfloat16")
    with pytest.raises(ValueError, match="must be 'auto' or one of .*'pallas-interpret'.*got 'palas'"):
        get_backend("palas")
    with pytest.raises(ValueError, match="'pallas-interpret' takes caches of dtype float32 / bfloat16 / float16 / int8 / fp8, "
                                         "got 'float64'"):
        select_backend("pallas-interpret", [AttentionSpec(0.1)], "float64")


def test_backend_entry_points_run_one_kernel_each():
    """decode runs the decode kernel, prefill the prefill kernel (no jnp attention); both match the reference."""
    for Q, qlens in [(1, [1, 1]), (4, [3, 1])]:
        q, k, v, tables, lens = make_case(1, lens=[5, 12], H=4, KVH=2, D=16, block_size=8, max_blocks=2,
                                          num_blocks=6, Q=Q)
        qlens = np.array(qlens, np.int32)
        f = lambda *a: run_backend(PALLAS_INTERPRET, *a, AttentionSpec(0.25))
        jaxpr = str(jax.make_jaxpr(f)(q, k, v, tables, lens, qlens))
        kernel = "paged_decode_attention" if Q == 1 else "paged_prefill_attention"
        assert kernel in jaxpr and jaxpr.count("pallas_call") == 1
        assert "dot_general" not in jaxpr.split("pallas_call")[0], "no jnp attention outside the kernel"
        got = np.asarray(jax.jit(f)(q, k, v, tables, lens, qlens))
        want = reference_prefill_f32(q, k, v, tables, lens, qlens, 0.25)
        for s, n in enumerate(qlens):
            np.testing.assert_allclose(got[s, :n], want[s, :n], atol=1e-5)


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
    backend = lambda *a: run_backend(PALLAS_INTERPRET, *a, AttentionSpec(0.25))
    jaxpr = str(jax.make_jaxpr(backend)(q, k, v, tables, lens, qlens))
    assert "f32[2,1,2,16,16]" in jaxpr  # partial outputs [S, KVH, partitions, Gp, D]
    got = jax.jit(backend)(q, k, v, tables, lens, qlens)
    want = paged_attention_reference(q, k, v, tables, lens, qlens, 0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ---- lowering for CUDA from the CPU-only jaxlib ------------------------------------------------------


def lower_for_cuda(f, *args) -> str:
    """The StableHLO text of ``f`` lowered for CUDA (an abstract H100 without a GPU: JAX >= 0.11 needs one)."""
    return cuda_lowering.lower_for_cuda(f, *args).as_text()


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.parametrize("dtype,D,block_size,partition_size", [
    ("float32", 64, 16, None), ("bfloat16", 128, 8, 32), ("float16", 128, 32, 64), ("bfloat16", 64, 16, 512)])
def test_decode_lowers_for_cuda_with_triton(dtype, D, block_size, partition_size):
    S, H, KVH, nb, mb = 8, 32, 8, 64, 48
    args = (sds((S, H, D), dtype), sds((nb, block_size, KVH, D), dtype), sds((nb, block_size, KVH, D), dtype),
            sds((S, mb), jnp.int32), sds((S,), jnp.int32), 0.125)
    f = functools.partial(paged_decode_attention, partition_size=partition_size, interpret=False)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(f, *args)


@pytest.mark.parametrize("dtype,D,block_size,G,Q,mb", [
    ("float32", 64, 16, 4, 32, 16), ("bfloat16", 128, 8, 1, 64, 16), ("float16", 128, 32, 8, 16, 16),
    ("bfloat16", 64, 16, 1, 2, 16), ("float16", 64, 1, 2, 128, 16), ("bfloat16", 128, 16, 3, 40, 13)])
def test_prefill_lowers_for_cuda_with_triton(dtype, D, block_size, G, Q, mb):
    S, KVH, nb = 4, 4, 64
    args = (sds((S, Q, KVH * G, D), dtype), sds((nb, block_size, KVH, D), dtype),
            sds((nb, block_size, KVH, D), dtype), sds((S, mb), jnp.int32), sds((S,), jnp.int32),
            sds((S,), jnp.int32), 0.125)
    text = lower_for_cuda(functools.partial(paged_prefill_attention, interpret=False), *args)
    assert "__gpu$xla.gpu.triton" in text and "paged_prefill_attention" in text


@pytest.mark.parametrize("spec", [AttentionSpec(0.125), AttentionSpec(0.125, sliding_window=40, logit_soft_cap=20.0)],
                         ids=["plain", "window_softcap"])
def test_pallas_backend_lowers_for_cuda_in_both_modes(spec):
    """The "pallas" backend (interpret=False) lowers for CUDA for decode and for prefill steps."""
    for Q in (1, 16):
        args = (sds((4, Q, 8, 64), "bfloat16"), sds((32, 16, 2, 64), "bfloat16"), sds((32, 16, 2, 64), "bfloat16"),
                sds((4, 8), jnp.int32), sds((4,), jnp.int32), sds((4,), jnp.int32))
        text = lower_for_cuda(lambda *a: run_backend(PALLAS, *a, spec), *args)
        assert text.count("__gpu$xla.gpu.triton") >= 1


DOT = re.compile(r"tt\.dot [^:]*?(?:inputPrecision = (\w+) )?: tensor<[\dx]+x(\w+)> \* tensor<[\dx]+x(\w+)> "
                 r"-> tensor<[\dx]+x(\w+)>")


@pytest.mark.parametrize("q_dtype,cache", [("float32", "float32"), ("float32", "int8"), ("bfloat16", "bfloat16"),
                                           ("float16", "float16"), ("bfloat16", "fp8")])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_kernels_multiply_in_float32_without_tf32(kernel, q_dtype, cache):
    """What Triton is asked to compile: both products of a float32 kernel (also over an 8-bit cache, whose
    values become float32) use IEEE float32 inputs (``inputPrecision`` ieee, Triton's default, so not
    printed), not TF32 (a 10-bit mantissa, ~1e-3 errors, which a GPU would otherwise use); 16-bit operands
    multiply natively; every product accumulates in float32 (float16 operands would otherwise accumulate
    in float16)."""
    D, bs = 64, 16
    width = D + 2 if cache in ("int8", "fp8") else D
    cache_dtype = {"int8": "int8", "fp8": "uint8"}.get(cache, cache)
    kv = sds((32, bs, 2, width), cache_dtype)
    if kernel == "decode":
        f = functools.partial(paged_decode_attention, interpret=False)
        args = (sds((4, 8, D), q_dtype), kv, kv, sds((4, 8), jnp.int32), sds((4,), jnp.int32), 0.125)
    else:
        f = functools.partial(paged_prefill_attention, interpret=False)
        args = (sds((4, 16, 8, D), q_dtype), kv, kv, sds((4, 8), jnp.int32), sds((4,), jnp.int32),
                sds((4,), jnp.int32), 0.125)
    [ttir] = cuda_lowering.triton_kernels_text(cuda_lowering.lower_for_cuda(f, *args))
    dots = DOT.findall(ttir)
    assert len(dots) == 2, ttir.count("tt.dot")  # scores and weighted values
    operand = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[q_dtype]
    for input_precision, a, b, acc in dots:
        assert (a, b, acc) == (operand, operand, "f32"), dots
        if q_dtype == "float32":
            assert input_precision in ("", "ieee"), dots


# ---- end to end: a tiny Llama (GQA, head_dim 16) with the kernels ----------------------------------


def test_tiny_llama_logits_pallas_vs_reference(tiny_llama_dir):
    """Prefill (the prefill kernel) and five decode steps (the decode kernel): logits equal the reference's."""
    from paged_jax.executor.batch import SeqChunk
    from paged_jax.models.loader import load_model
    from tests.model_helpers import PagedRunner

    config, params = load_model(tiny_llama_dir, dtype="float32")
    runners = {b: PagedRunner(config, params, block_size=4, num_blocks=32, seed=3, backend=b)
               for b in ("reference", "pallas-interpret")}
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, config.vocab_size, size=n)) for n in (1, 6, 13)]
    seqs = [list(p) for p in prompts]
    tables = {b: [r.table_for([], len(p)) for p in prompts] for b, r in runners.items()}
    chunks = {b: [SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables[b])] for b in runners}
    for step in range(6):
        logits = {}
        for b, r in runners.items():
            out, batch = r.run(chunks[b])
            logits[b] = out[batch.last_token[: batch.num_seqs]]
        np.testing.assert_allclose(logits["pallas-interpret"], logits["reference"], atol=1e-4, rtol=0)
        nxt = logits["reference"].argmax(-1)
        for s, tok in zip(seqs, nxt):
            s.append(int(tok))
        chunks = {b: [SeqChunk([s[-1]], len(s) - 1, runners[b].table_for(t, len(s)))
                      for s, t in zip(seqs, tables[b])] for b in runners}


def test_engine_pallas_interpret_matches_reference_greedy(tiny_llama_dir):
    """The engine with both kernels (chunked prefill: prefill chunks beside decodes) gives the reference's tokens."""
    from paged_jax import LLM, SamplingParams

    prompts = [[5, 9, 200, 31, 7, 77, 8, 19, 4, 11, 300, 12, 6], [42], [3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=5)
    got = {}
    for backend in ("reference", "pallas-interpret"):
        llm = LLM(model=str(tiny_llama_dir), attention_backend=backend, block_size=4, num_kv_blocks=24,
                  enable_chunked_prefill=True, max_num_batched_tokens=8)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got[backend] = [o.outputs[0].token_ids for o in outs]
    assert got["pallas-interpret"] == got["reference"]
    assert all(len(t) == 5 for t in got["reference"])


# ---- experiments/bench_kernel.py ---------------------------------------------------------------------


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "experiments" / "bench_kernel.py"
    spec = importlib.util.spec_from_file_location("bench_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_kernel_runs_small_on_cpu(capsys):
    """The benchmark checks its variants agree before timing them, and prints one row per setting."""
    bench = _bench_module()
    assert bench.main(["--batch", "2", "--context", "16", "40", "--num-heads", "4", "--head-dim", "16",
                       "--iters", "1", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith(("#", "batch"))]
    assert [r[:2] for r in rows] == [["2", "16"], ["2", "40"]]
    assert all(float(x.removesuffix("%")) > 0 for r in rows for x in r[2:])
    from paged_jax import native

    if native.available():  # the native kernel on scattered and on consecutive blocks, their ratio, and its
        # K/V read rate (GB/s and % of the device's copy bandwidth)
        assert all(len(r) == 2 + 4 + 2 + 2 and r[-1].endswith("%") for r in rows)


def test_bench_kernel_gpu_variants_lower_for_cuda():
    """The GPU columns (our paged kernel, JAX's contiguous Pallas kernel) lower for CUDA in Fig. 18a's shapes."""
    bench = _bench_module()
    fns, pairs = bench.variants(on_gpu=True, scale=128 ** -0.5, dtype="float16")
    assert ("paged Pallas kernel", "contiguous Pallas kernel") in pairs
    for L in (64, 256):
        inputs = {k: jax.ShapeDtypeStruct(x.shape, x.dtype)
                  for k, x in bench.make_inputs(2, L, 8, 8, 128, 16, "float16").items()}
        for name in ("paged Pallas kernel", "contiguous Pallas kernel"):
            fn, names = fns[name]
            assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *[inputs[a] for a in names]), name


def test_stale_nan_and_inf_in_unused_slots_do_not_leak():
    """A reused block may hold Inf/NaN past a sequence's length (e.g. a float16 overflow of an
    earlier sequence): the decode kernel, the prefill kernel and the reference ignore them."""
    lens, qlens = [5, 13], [5, 2]
    q, k, v, tables, lens_a = make_case(21, lens=lens, H=4, KVH=2, D=16, block_size=8, max_blocks=2, num_blocks=8,
                                        Q=8)
    k, v = k.copy(), v.copy()
    clean = reference_prefill_f32(q, k, v, tables, lens_a, np.asarray(qlens, np.int32), 0.25)
    for s, n in enumerate(lens):  # poison every slot past each sequence's end, in its own last block
        last = tables[s, (n - 1) // 8]
        k[last, n % 8 or 8:] = np.inf
        v[last, n % 8 or 8:] = np.nan
    got_ref = reference_prefill_f32(q, k, v, tables, lens_a, np.asarray(qlens, np.int32), 0.25)
    got_pre = np.asarray(jitted_prefill()(q, k, v, tables, lens_a, np.asarray(qlens, np.int32), 0.25))
    got_dec = run_kernel(q[:, 0], k, v, tables, lens_a, 0.25)
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got_ref[s, :n], clean[s, :n], atol=1e-6)
        np.testing.assert_allclose(got_pre[s, :n], clean[s, :n], atol=1e-5)
    want_dec = reference_f32(q[:, 0], k, v, tables, lens_a, 0.25)
    assert np.isfinite(want_dec).all()
    np.testing.assert_allclose(got_dec, want_dec, atol=1e-5)
    # The engine's decode path for the reference backend (a CPU-friendly layout of the same function).
    from paged_jax.attention import paged_decode_attention

    got_fast = np.asarray(paged_decode_attention(jnp.asarray(q[:, 0]), jnp.asarray(k), jnp.asarray(v),
                                                 jnp.asarray(tables), jnp.asarray(lens_a), 0.25))
    np.testing.assert_allclose(got_fast, want_dec, atol=1e-5)
