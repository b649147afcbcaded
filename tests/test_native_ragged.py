"""The native kernel on a whole ragged step (``native.paged_attention``): token-flat queries of decode
rows and prefill chunks (after a cached prefix or not), padding rows and tokens no row owns, against
the numpy oracle, in every cache dtype; both of its ways to score a block (a dot product per key for
a head with few query rows, transposed keys for many) and rows cut into several work items."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import native
from paged_jax.attention import kv_quant
from tests.native_paths import PORTABLE_FLAGS, native_paths_report, run_build  # noqa: F401 (autouse: the report)
from tests.attention_oracle import numpy_attention
from tests.test_kv_quant_kernels import numpy_dequantize
from tests.slow_cases import slow_unless

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel not built: {native.status()}")


def ragged_case(rng, H, KVH, D, block_size, query_lens, contexts, num_blocks=None):
    """Rows with ``query_lens`` new tokens ending at ``contexts`` keys, laid out token-flat in a
    shuffled order with a gap of unowned tokens after each row; caches with the null block and each
    row's unused slots poisoned (NaN / Inf), as a real cache may hold."""
    S = len(query_lens)
    widths = [-(-c // block_size) for c in contexts]
    num_blocks = num_blocks or sum(widths) + 1
    k = rng.standard_normal((num_blocks, block_size, KVH, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, KVH, D)).astype(np.float32)
    tables = np.zeros((S, max(widths)), np.int32)
    pool = list(rng.permutation(np.arange(1, num_blocks)))
    for s, (c, w) in enumerate(zip(contexts, widths)):
        tables[s, :w] = [pool.pop() for _ in range(w)]
        last, used = tables[s, w - 1], c - (w - 1) * block_size
        k[last, used:], v[last, used:] = np.nan, np.inf
    k[0], v[0] = np.nan, np.nan
    starts, t = np.zeros(S, np.int32), 0
    for s in rng.permutation(S):
        starts[s], t = t, t + query_lens[s] + int(rng.integers(0, 3))
    q = rng.standard_normal((t + 2, H, D)).astype(np.float32)
    return q, k, v, tables, np.asarray(contexts, np.int32), starts, np.asarray(query_lens, np.int32)


def quantized_cache(k, v, dtype="int8"):
    """K/V (NaN and +inf zeroed) stored in an 8-bit cache of kv_quant's layout (or a bfloat16 one, its
    bits in uint16), and the K/V a reader of that cache sees (the oracle's): ``(k, v, k_seen, v_seen)``."""
    D = k.shape[-1]
    k, v = (kv_quant.quantize(jnp.asarray(np.nan_to_num(x, nan=0, posinf=0)), kv_quant.storage_dtype(dtype, "float32"))
            for x in (k, v))
    return k, v, numpy_dequantize(np.asarray(k), D), numpy_dequantize(np.asarray(v), D)


def oracle(q, k, v, tables, lens, starts, qlens, scale, window=None, cap=None, sinks=None):
    """numpy_attention row by row, back to token-flat; tokens no row owns are zeros."""
    out = np.zeros(q.shape, np.float64)
    for s in range(len(lens)):
        n = int(qlens[s])
        if n:
            rows = q[None, starts[s]:starts[s] + n]
            out[starts[s]:starts[s] + n] = numpy_attention(rows, k, v, tables[s:s + 1], lens[s:s + 1],
                                                           qlens[s:s + 1], scale, window=window, cap=cap,
                                                           sinks=sinks)[0]
    return out


# (H, KVH, D, block_size): a head of 64 and of 128 (the unrolled sizes) and of 20 (any); block sizes under,
# at and over one vector of 16 keys; one, two and eight query heads per KV head.
SHAPES = [(8, 8, 64, 16), (8, 2, 128, 32), (4, 1, 20, 8), (6, 3, 64, 5)]


@pytest.mark.parametrize("H,KVH,D,block_size", SHAPES)
def test_ragged_step_matches_numpy(H, KVH, D, block_size):
    rng = np.random.default_rng(H * 1000 + D + block_size)
    # decodes (short and long contexts), whole prompts, chunks after a cached prefix, a padding row,
    # and a 150-query chunk: several work items of one row
    query_lens = [1, 1, 1, 37, 150, 2, 9, 0, 1, 64]
    contexts = [1, 70, 200, 37, 300, 2, 120, 5, 17, 64]
    q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, block_size, query_lens, contexts)
    scale = 1 / math.sqrt(D)
    got = np.asarray(jax.jit(native.paged_attention, static_argnums=7)(q, k, v, tables, lens, starts, qlens, scale))
    want = oracle(q, k, v, tables, lens, starts, qlens, scale)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    owned = np.zeros(len(q), bool)
    for s, n in zip(starts, qlens):
        owned[s:s + n] = True
    assert not got[~owned].any() and not owned.all()  # the unowned tokens (there are some) are zeros


def window_cap_case(H, KVH, D, block_size, window, cap):
    """A ragged step with a sliding window and / or a soft-cap: (the kernel's arguments, the oracle's
    output). Blocks wholly before every query's window are poisoned with NaN."""
    rng = np.random.default_rng(D + (window or 0))
    query_lens, contexts = [1, 1, 37, 150, 9, 0], [1, 70, 37, 300, 120, 5]
    q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, block_size, query_lens, contexts)
    q = q * 3
    want = oracle(q, k, v, tables, lens, starts, qlens, 0.3, window, cap)
    plain = oracle(q, k, v, tables, lens, starts, qlens, 0.3)
    assert np.abs(want - plain).max() > 1e-2  # the window or cap does change the result
    if window is not None:  # as a windowed engine may: blocks no query still sees hold anything
        for s, (n, c) in enumerate(zip(query_lens, contexts)):
            first_seen = max(0, c - n - window + 1)
            k[tables[s, :first_seen // block_size]] = np.nan
            v[tables[s, :first_seen // block_size]] = np.nan
    return (q, k, v, tables, lens, starts, qlens, 0.3, window, cap), want


@pytest.mark.parametrize("H,KVH,D,block_size", slow_unless(SHAPES, {8}))  # 8 and 2 KV heads; 1 and 3: -m slow
@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_a_row_costing_most_of_the_step_is_split_by_heads(H, KVH, D, block_size, cache):
    """A one-block chunk late in a long context beside short decodes, then a lone decode over a long
    context: each costs more than a thread's share, so the kernel splits it by KV heads over the
    threads (XLA's CPU pool has one a core); the numbers are the oracle's, in a float32 and an 8-bit
    cache (whose entries are D + 2 bytes apart)."""
    rng = np.random.default_rng(KVH * 100 + D)
    for query_lens, contexts in (([1, 1, 1, block_size], [20, 33, 50, 3000]), ([1], [5000])):
        q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, block_size, query_lens, contexts)
        scale = 1 / math.sqrt(D)
        if cache == "int8":
            k, v, k_seen, v_seen = quantized_cache(k, v)
            want = oracle(q, k_seen, v_seen, tables, lens, starts, qlens, scale)
        else:
            want = oracle(q, k, v, tables, lens, starts, qlens, scale)
        got = native.paged_attention(q, k, v, tables, lens, starts, qlens, scale)
        np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("H,KVH,D,block_size", [SHAPES[0], SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("window,cap", [(None, None), (1000, 2.0)])
def test_a_long_row_is_read_in_parts_and_merged(H, KVH, D, block_size, window, cap):
    """Rows of more than 2,048 keys are read in parts of whole chunks (from fixed positions), one work
    item each, and merged by rescaling each part's sums to the largest max: a decode whose last part
    holds a few keys, a 16-query chunk (query tiles) and a 3-query row crossing part boundaries, beside a
    short decode; with a window that skips whole parts, a soft-cap, and sinks (counted once, not once a
    part)."""
    rng = np.random.default_rng(H + D + (window or 0))
    query_lens, contexts = [1, 16, 3, 1], [4100, 4500, 2050, 30]
    q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, block_size, query_lens, contexts)
    sinks = rng.standard_normal(H).astype(np.float32) * 2
    scale = 1 / math.sqrt(D)
    want = oracle(q, k, v, tables, lens, starts, qlens, scale, window, cap)
    got = native.paged_attention(q, k, v, tables, lens, starts, qlens, scale, window, cap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
    want = oracle(q, k, v, tables, lens, starts, qlens, scale, window, cap, sinks)
    got = native.paged_attention(q, k, v, tables, lens, starts, qlens, scale, window, cap, sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("window,cap", [(7, None), (40, 2.0), (None, 1.5), (1, None)])
@pytest.mark.parametrize("H,KVH,D,block_size", [SHAPES[0], SHAPES[2]])
def test_sliding_window_and_soft_cap(H, KVH, D, block_size, window, cap):
    """A window shorter than a block, over several chunks, of one key; a soft-cap under the scores'
    spread (so that it changes them). Blocks wholly before every query's window are never read."""
    args, want = window_cap_case(H, KVH, D, block_size, window, cap)
    np.testing.assert_allclose(np.asarray(native.paged_attention(*args)), want, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("H,KVH,D,block_size,window,cap,cache", [
    (8, 8, 64, 16, None, None, "float32"), (8, 8, 64, 16, 100, 1.5, "float32"), (6, 3, 64, 5, 37, None, "float32"),
    (8, 4, 128, 32, None, None, "float32"), (8, 8, 64, 16, None, None, "int8")])
def test_few_query_rows_over_a_long_context(H, KVH, D, block_size, window, cap, cache):
    """Rows of 1 to 7 queries (fewer query rows a KV head than half a vector of the query tiles: dot
    products or transposed keys) over hundreds of keys, with a window (blocks wholly before every
    query's window poisoned) or a soft-cap, with one, two and four query heads a KV head, in a float32
    and an int8 cache."""
    rng = np.random.default_rng(H + KVH * 10 + D + (window or 0))
    query_lens, contexts = [1, 2, 3, 4, 5, 6, 7], [600, 377, 509, 260, 301, 433, 550]
    q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, block_size, query_lens, contexts)
    scale = 1 / math.sqrt(D)
    if cache == "int8":
        k, v, k_seen, v_seen = quantized_cache(k, v)
        want = oracle(q, k_seen, v_seen, tables, lens, starts, qlens, scale, window, cap)
    else:
        want = oracle(q, k, v, tables, lens, starts, qlens, scale, window, cap)
        for s, (n, c) in enumerate(zip(query_lens, contexts)):  # then, as a windowed engine may: blocks
            first_seen = max(0, c - n - (window or c) + 1)  # no query still sees hold anything
            k[tables[s, :first_seen // block_size]] = np.nan
            v[tables[s, :first_seen // block_size]] = np.nan
    got = native.paged_attention(q, k, v, tables, lens, starts, qlens, scale, window, cap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)


def test_decode_rows_are_the_decode_kernel():
    """``paged_decode`` is the ragged kernel with a query a row: the same numbers, bit for bit."""
    rng = np.random.default_rng(5)
    q, k, v, tables, lens, _, _ = ragged_case(rng, 8, 2, 64, 16, [1] * 9, [1, 15, 16, 17, 40, 90, 3, 64, 33])
    q = q[:9]
    ragged = native.paged_attention(q, k, v, tables, lens, np.arange(9, dtype=np.int32), np.ones(9, np.int32), 0.125)
    np.testing.assert_array_equal(np.asarray(native.paged_decode(q, k, v, tables, lens, 0.125)), np.asarray(ragged))


def cache_dtype_case(dtype):
    """A ragged step in bfloat16 (queries and caches), float32 queries over a bfloat16 cache ("bfloat16
    cache") or over an 8-bit cache: (the kernel's arguments, the oracle's output, the tolerance)."""
    H, KVH, D, bs = 8, 2, 64, 16
    rng = np.random.default_rng(7)
    q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, bs, [1, 40, 1, 100], [30, 40, 120, 260])
    k, v = np.nan_to_num(k, nan=0, posinf=0), np.nan_to_num(v, nan=0, posinf=0)  # finite: quantized below
    if dtype == "bfloat16":
        q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
        want = oracle(*(np.asarray(x, np.float32) for x in (q, k, v)), tables, lens, starts, qlens, 0.125)
        tol = 1e-2  # a bfloat16 output
    elif dtype == "bfloat16 cache":
        k, v, k_seen, v_seen = quantized_cache(k, v, "bfloat16")
        want = oracle(q, k_seen, v_seen, tables, lens, starts, qlens, 0.125)
        tol = 1e-5
    else:
        k, v, k_seen, v_seen = quantized_cache(k, v, dtype)
        want = oracle(q, k_seen, v_seen, tables, lens, starts, qlens, 0.125)
        tol = 1e-5
    return (q, k, v, tables, lens, starts, qlens, 0.125), want, tol


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16 cache", "int8", "fp8"])
def test_ragged_step_in_every_cache_dtype(dtype):
    """bfloat16 queries and caches (the oracle reads the rounded values), float32 queries over a
    bfloat16 cache (kv_cache_dtype="bfloat16": the oracle reads the rounded values) or over an 8-bit
    cache in kv_quant's layout (the oracle reads the dequantized values)."""
    args, want, tol = cache_dtype_case(dtype)
    got = native.paged_attention(*args)
    assert got.dtype == args[0].dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("H,KVH,D,block_size", SHAPES)
def test_a_bfloat16_cache_reads_as_its_float32_widening(H, KVH, D, block_size):
    """float32 queries over a bfloat16 cache (kv_cache_dtype="bfloat16" beside float32 weights) give,
    bit for bit, what the float32 kernel gives over the same values widened to float32, in both ways
    of scoring a block (a dot product a key for a head with few rows, transposed keys or query tiles
    for many) and in heads of 64, 128 and 20 (the unrolled and the any-size loops); and the oracle's
    numbers over those values."""
    rng = np.random.default_rng(D + KVH)
    q, k, v, tables, lens, starts, qlens = ragged_case(rng, H, KVH, D, block_size, [1, 1, 40, 3, 0], [1, 90, 40, 300, 3])
    k16, v16, k_seen, v_seen = quantized_cache(k, v, "bfloat16")
    assert k16.dtype == jnp.uint16  # the cache's layout: bfloat16 bits
    got = native.paged_attention(q, k16, v16, tables, lens, starts, qlens, 0.25)
    assert got.dtype == jnp.float32
    wide = native.paged_attention(q, jnp.asarray(k_seen), jnp.asarray(v_seen), tables, lens, starts, qlens, 0.25)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(wide))
    want = oracle(q, k_seen, v_seen, tables, lens, starts, qlens, 0.25)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_rows_outside_the_queries_or_overlapping_are_refused():
    q = jnp.zeros((4, 2, 16))
    cache = jnp.zeros((3, 4, 2, 16))
    tables, lens = jnp.ones((1, 2), jnp.int32), jnp.array([6], jnp.int32)
    with pytest.raises(Exception, match="outside the queries"):
        native.paged_attention(q, cache, cache, tables, lens, jnp.array([2]), jnp.array([3]), 1.0).block_until_ready()
    with pytest.raises(Exception, match="two rows own the same query token"):
        native.paged_attention(q, cache, cache, jnp.ones((2, 2), jnp.int32), jnp.array([6, 6]), jnp.array([0, 1]),
                               jnp.array([2, 2]), 1.0).block_until_ready()
    with pytest.raises(ValueError, match=r"query_starts \(2,\)"):
        native.paged_attention(q, cache, cache, tables, lens, jnp.array([0, 1]), jnp.array([3]), 1.0)


PORTABLE_CHECK = """
import json
import numpy as np
from paged_jax import native
from tests.test_native_ragged import SHAPES, cache_dtype_case, oracle, quantized_cache, ragged_case, window_cap_case
assert native.available(), native.status()
checks = []  # (case, largest error, tolerance)
for H, KVH, D, bs in SHAPES:
    rng = np.random.default_rng(D)
    case = ragged_case(rng, H, KVH, D, bs, [1, 1, 40, 70, 0], [1, 90, 40, 200, 3])
    got = np.asarray(native.paged_attention(*case, 0.25))
    checks.append((f"float32 {H}/{KVH} heads of {D}, blocks of {bs}", float(np.abs(got - oracle(*case, 0.25)).max()),
                   2e-5))
rng = np.random.default_rng(1)
case = ragged_case(rng, 8, 8, 64, 16, [1, 2, 4, 7], [300, 250, 410, 170])  # few queries a row
got = np.asarray(native.paged_attention(*case, 0.125))
checks.append(("few queries a row", float(np.abs(got - oracle(*case, 0.125)).max()), 2e-5))
for window, cap in [(7, None), (40, 2.0)]:
    args, want = window_cap_case(*SHAPES[0], window, cap)
    got = np.asarray(native.paged_attention(*args))
    checks.append((f"window {window}, soft-cap {cap}", float(np.abs(got - want).max()), 3e-5))
rng = np.random.default_rng(2)
case = ragged_case(rng, 8, 8, 64, 16, [1, 16, 3], [4100, 4500, 2050])  # long rows, read in parts
got = np.asarray(native.paged_attention(*case, 0.125))
checks.append(("long rows in parts", float(np.abs(got - oracle(*case, 0.125)).max()), 2e-5))
for dtype in ["bfloat16", "bfloat16 cache", "int8", "fp8"]:
    args, want, tol = cache_dtype_case(dtype)
    got = np.asarray(native.paged_attention(*args), np.float32)
    checks.append((f"{dtype} cache", float(np.abs(got - want).max()), tol))
rng = np.random.default_rng(3)  # float32 decodes over a bfloat16 cache, one query head a KV head: a dot product a key
q, k, v, tables, lens, starts, qlens = ragged_case(rng, 8, 8, 64, 16, [1, 1, 1], [1, 90, 300])
k, v, k_seen, v_seen = quantized_cache(k, v, "bfloat16")
got = np.asarray(native.paged_attention(q, k, v, tables, lens, starts, qlens, 0.125))
checks.append(("bfloat16 cache, decodes", float(np.abs(got - oracle(q, k_seen, v_seen, tables, lens, starts, qlens,
                                                                     0.125)).max()), 2e-5))
print(json.dumps({"checks": checks, "status": native.status()}))
"""


def _check_build(out):
    assert {"attention float32", "attention bfloat16", "attention bfloat16 cache", "attention int8 cache",
            "attention fp8 cache"} <= set(out["status"]["traced"])
    bad = [(case, err, tol) for case, err, tol in out["checks"] if not err < tol]
    assert len(out["checks"]) == 13 and not bad, bad


def test_avx2_path_without_avx512(tmp_path_factory):
    """The kernel's AVX2 code (built with -mno-avx512f, in its own process: keys transposed 8 x 8 in
    registers, weighted values in 8-float registers; the plain loops where the CPU has no AVX2)
    gives the same attention, in every cache dtype, with a sliding window and a soft-cap."""
    out = run_build(PORTABLE_CHECK, tmp_path_factory, "test_native_ragged.py::test_avx2_path_without_avx512")
    assert out["status"]["paths"]["attention"] == ("avx2" if "avx2" in native.cpu_isa() else "portable")
    _check_build(out)


@pytest.mark.slow
def test_portable_loops_without_avx2(tmp_path_factory):
    """The plain loops (built with -mno-avx512f -mno-avx2 -mno-fma: keys transposed element by
    element, plain value loops) give the same attention."""
    out = run_build(PORTABLE_CHECK, tmp_path_factory, "test_native_ragged.py::test_portable_loops_without_avx2",
                    PORTABLE_FLAGS)
    assert out["status"]["paths"]["attention"] == "portable"
    _check_build(out)
