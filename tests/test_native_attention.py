"""The native CPU attention kernel on decode rows (paged_jax/native) against a numpy oracle, the "native" backend, and its fallback."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import native
from paged_jax.attention import (AttentionMetadata, as_ragged, AttentionSpec, paged_attention_reference, paged_decode_attention,
                                 select_backend)
from paged_jax.attention.backends import NATIVE, REFERENCE
from tests.native_paths import native_paths_report  # noqa: F401 (autouse: the paths report)

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel not built: {native.status()}")


def numpy_decode(q, k_cache, v_cache, tables, lens, scale):
    """Loops over sequences and heads, reading each token's K/V through the block table."""
    S, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    out = np.zeros((S, H, D), np.float64)
    for s in range(S):
        L = int(lens[s])
        if L == 0:
            continue
        rows = [(tables[s][t // bs], t % bs) for t in range(L)]
        for h in range(H):
            kvh = h // (H // KVH)
            k = np.stack([k_cache[b, o, kvh] for b, o in rows]).astype(np.float64)
            v = np.stack([v_cache[b, o, kvh] for b, o in rows]).astype(np.float64)
            x = k @ q[s, h] * scale
            p = np.exp(x - x.max())
            out[s, h] = (p / p.sum()) @ v
    return out


def make_case(rng, S, H, KVH, D, block_size, max_blocks, num_blocks, poison=True):
    k_cache = rng.standard_normal((num_blocks, block_size, KVH, D)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, KVH, D)).astype(np.float32)
    lens = rng.integers(1, max_blocks * block_size + 1, S).astype(np.int32)
    lens[rng.integers(0, S)] = max_blocks * block_size  # one full row
    tables = np.zeros((S, max_blocks), np.int32)
    perm = rng.permutation(np.arange(1, num_blocks))
    for s in range(S):
        n = -(-int(lens[s]) // block_size)
        tables[s, :n], perm = perm[:n], perm[n:]
        if poison:  # stale Inf/NaN in the unused slots of the last block must not matter
            last, used = tables[s, n - 1], int(lens[s]) - (n - 1) * block_size
            k_cache[last, used:] = np.nan
            v_cache[last, used:] = np.inf
    if poison:
        k_cache[0] = np.nan  # the null block, which pads every table
        v_cache[0] = np.nan
    q = rng.standard_normal((S, H, D)).astype(np.float32)
    return q, k_cache, v_cache, tables, lens


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("H,KVH,D,block_size", [(4, 4, 8, 4), (8, 2, 64, 16), (6, 1, 20, 3), (12, 12, 64, 16),
                                                (4, 2, 128, 1)])
def test_native_matches_numpy(H, KVH, D, block_size, dtype):
    rng = np.random.default_rng(H * 100 + D + block_size)
    S, max_blocks = 37, 7  # more sequences than the thread pool's chunks
    num_blocks = S * max_blocks + 1
    q, k, v, tables, lens = make_case(rng, S, H, KVH, D, block_size, max_blocks, num_blocks)
    scale = 1 / math.sqrt(D)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    got = jax.jit(native.paged_decode, static_argnums=5)(q, k, v, tables, lens, scale)
    assert got.dtype == jnp.dtype(dtype)
    # The oracle reads the same (rounded) values, in float64.
    want = numpy_decode(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), tables, lens, scale)
    tol = 2e-5 if dtype == "float32" else 1e-2  # bfloat16 output: 8 bits of mantissa
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol)


@needs_native
def test_out_of_range_lengths_and_table_entries_read_as_the_reference_does():
    """Lengths past the table or negative, and table entries past the pool or negative (as jnp's
    gather: counted from the end, then clamped), give the reference's values."""
    rng = np.random.default_rng(11)
    q, k, v, tables, lens = make_case(rng, 6, 4, 2, 16, 4, 3, 19, poison=False)
    lens[0] = 100  # more than the table's 12 slots: all 12
    lens[1] = -3  # nothing: zeros
    tables[2, 1] = -1  # the last block of the pool
    tables[3, 0] = 99  # past the pool: clamped to the last block
    tables[4, 2] = -25  # before the pool's start once wrapped: clamped to block 0
    args = [jnp.asarray(x) for x in (q, k, v, tables, lens)]
    got = np.asarray(native.paged_decode(*args, 0.25))
    want = np.asarray(paged_attention_reference(args[0][:, None], *args[1:], jnp.ones(6, jnp.int32), 0.25)[:, 0])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert (got[1] == 0).all()


@needs_native
def test_padding_rows_and_empty_batch():
    rng = np.random.default_rng(3)
    q, k, v, tables, lens = make_case(rng, 6, 4, 2, 16, 4, 3, 19)
    lens[[1, 4]] = 0  # padded rows: zeros, and their neighbours unaffected
    got = np.asarray(native.paged_decode(q, k, v, tables, lens, 0.25))
    assert (got[[1, 4]] == 0).all()
    np.testing.assert_allclose(got, numpy_decode(q, k, v, tables, lens, 0.25), rtol=2e-5, atol=2e-5)
    empty = native.paged_decode(q[:0], k, v, tables[:0], lens[:0], 0.25)
    assert empty.shape == (0, 4, 16)


@needs_native
def test_mismatched_shapes_are_refused_with_the_shapes():
    q = jnp.zeros((2, 6, 8), jnp.float32)
    k = jnp.zeros((5, 4, 4, 8), jnp.float32)  # 4 KV heads do not divide 6 query heads
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32)
    with pytest.raises(ValueError, match=r"6 query heads.*\(5, 4, 4, 8\)"):
        native.paged_decode(q, k, k, tables, lens, 1.0)
    with pytest.raises(ValueError, match=r"got q \(2, 6\)"):
        native.paged_decode(q[:, :, 0], k, k, tables, lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        native.paged_decode(q[:, :4], k, k, tables, lens[:1], 1.0)


def _decode(backend, q, k, v, tables, lens, scale):
    """A step of one new token per sequence through the backend's one entry point (as the layer calls it)."""
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    meta = AttentionMetadata(slot_mapping=None, token_seq=rows, block_tables=tables, context_lens=lens,
                             query_lens=jnp.ones_like(lens), last_token=rows)
    return as_ragged(backend).ragged(q, k, v, meta, AttentionSpec(scale))


@needs_native
def test_native_backend_runs_the_kernel_and_reference_does_not():
    rng = np.random.default_rng(5)
    q, k, v, tables, lens = make_case(rng, 16, 8, 2, 32, 16, 4, 65, poison=False)
    args = tuple(jnp.asarray(x) for x in (q, k, v, tables, lens))
    fn = jax.jit(lambda *a: _decode(NATIVE, *a, 0.2))
    assert native.TARGETS["float32"][0] in fn.lower(*args).as_text()
    jnp_path = jax.jit(lambda *a: _decode(REFERENCE, *a, 0.2))
    assert "paged_jax_paged_attention" not in jnp_path.lower(*args).as_text()  # plain jnp, no C++
    ref = paged_attention_reference(args[0][:, None], *args[1:], jnp.ones(16, jnp.int32), 0.2)[:, 0]
    np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jnp_path(*args)), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(paged_decode_attention(*args, 0.2)), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # bfloat16 runs its own variant; the backend refuses float16 at engine start.
    bf = [a.astype(jnp.bfloat16) for a in args[:3]]
    assert native.TARGETS["bfloat16"][0] in jax.jit(lambda *a: _decode(NATIVE, *a, 0.2)).lower(*bf, *args[3:]).as_text()
    NATIVE.check(AttentionSpec(0.2), "bfloat16")
    with pytest.raises(ValueError, match="'native' takes caches of dtype float32 / bfloat16 / int8 / fp8, got 'float16'"):
        select_backend("native", [AttentionSpec(0.2)], "float16")  # its declared dtypes
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.paged_decode(args[0], args[1].astype(jnp.bfloat16), args[2], *args[3:], 0.2)


@needs_native
def test_engine_greedy_tokens_same_with_and_without_native(tiny_llama_dir, monkeypatch):
    from paged_jax import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(2, 40, 6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4, seed=0, **kw)
        toks = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                             use_tqdm=False)]
        return toks, llm.llm_engine.get_stats()["attention_backend"]

    with_native, name = run()
    assert name == "native"  # the default ("auto") on a CPU where the kernel builds
    assert run(attention_backend="reference") == (with_native, "reference")  # native matmuls, jnp attention
    monkeypatch.setattr(native, "available", lambda: False)
    assert run() == (with_native, "reference")  # XLA only: unpacked weights, XLA matmuls, jnp attention
    with pytest.raises(ValueError, match="attention_backend='native' cannot run this model: the native library"):
        run(attention_backend="native")


def test_failed_build_falls_back_to_jnp(tmp_path, monkeypatch, caplog):
    saved = dict(native._state)
    try:
        native._state.clear()
        monkeypatch.setenv("PAGED_JAX_HOME", str(tmp_path))  # no cached library here
        monkeypatch.setenv("CXX", "false")  # a compiler that always fails
        with caplog.at_level(logging.WARNING, logger="paged_jax"):
            assert not native.available()
        assert "native CPU kernels unavailable" in caplog.text and "failed" in native.status()["error"]
        q = jnp.ones((2, 4, 8), jnp.float32)
        k = jnp.ones((5, 4, 2, 8), jnp.float32)
        out = paged_decode_attention(q, k, k, jnp.asarray([[1, 2], [3, 4]], jnp.int32), jnp.asarray([5, 8], jnp.int32),
                                     0.5)
        np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)
        monkeypatch.setenv("PAGED_JAX_NATIVE", "0")  # switched off: not even tried
        native._state.clear()
        assert not native.available() and native._state == {}
    finally:
        native._state.clear()
        native._state.update(saved)


def test_kernel_builds_where_a_compiler_is_found():
    """A machine with g++ must get the kernel: a broken build would otherwise only show as skips."""
    import os
    import shutil

    if os.environ.get("PAGED_JAX_NATIVE") == "0" or os.environ.get("CXX") or not shutil.which("g++"):
        pytest.skip("native kernel switched off, or no g++ here")
    assert native.available(), native.status()
