"""Blockwise prefill attention (paged_jax/attention/prefill.py): the same function as the dense
reference (random lengths, block tables, chunked-prefill contexts, windows, soft-caps, hooks,
GQA, chunk sizes that split queries and pages), the numpy oracle's result, no leak of stale slots,
chunks before a window never read, and the default CPU prefill path's memory linear in the prompt."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from paged_jax.attention import (AttentionMetadata, AttentionSpec, REFERENCE, blockwise_prefill_attention,
                                 paged_attention_reference, soft_cap_mod, window_mask_mod)
from tests.attention_oracle import numpy_attention
from tests.test_attention_variants import random_case
from tests.slow_cases import slow_unless


def random_batch(rng, S, H, KVH, D, block_size, max_len):
    """S sequences of random context length, each with a random number of new queries (a whole
    prompt, a chunk after a cached prefix, or one token), scattered over a shuffled block pool."""
    lens = rng.integers(1, max_len + 1, size=S).astype(np.int32)
    qlens = np.array([rng.choice([n, rng.integers(1, n + 1), 1]) for n in lens], np.int32)
    Q = int(qlens.max())
    mb = -(-int(lens.max()) // block_size) + int(rng.integers(0, 3))  # tables sometimes wider than needed
    nb = S * mb + 1
    tables = rng.permutation(np.arange(1, nb))[: S * mb].reshape(S, mb).astype(np.int32)
    k = rng.normal(size=(nb, block_size, KVH, D)).astype(np.float32)
    v = rng.normal(size=(nb, block_size, KVH, D)).astype(np.float32)
    q = (rng.normal(size=(S, Q, H, D)) * 2).astype(np.float32)
    return q, k, v, tables, lens, qlens


def assert_rows_close(got, want, qlens, atol=2e-5, msg=""):
    got, want = np.asarray(got), np.asarray(want)
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got[s, :n], want[s, :n], atol=atol, rtol=0, err_msg=f"{msg} row {s}")


# seeds 0-3 cover the four head layouts, block sizes 1 and 4; 4-7 (block sizes 8 and 16): -m slow
@pytest.mark.parametrize("seed", slow_unless(range(8), {0, 1, 2, 3}))
def test_blockwise_matches_the_reference_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    H, KVH = [(4, 2), (4, 4), (6, 1), (8, 2)][seed % 4]
    block_size = [1, 4, 8, 16][seed // 2 % 4]
    q, k, v, tables, lens, qlens = random_batch(rng, S=int(rng.integers(1, 5)), H=H, KVH=KVH, D=8,
                                                block_size=block_size, max_len=90)
    window = [None, 1, 7, 40][seed % 4]
    cap = [None, 0.7, None, 3.0][seed // 2 % 4]
    q_chunk, kv_chunk = [(4, 8), (16, 4), (7, 24), (256, 512)][seed % 4]
    want = paged_attention_reference(q, k, v, tables, lens, qlens, 0.3, score_mod=soft_cap_mod(cap),
                                     mask_mod=window_mask_mod(window))
    got = blockwise_prefill_attention(q, k, v, tables, lens, qlens, 0.3, score_mod=soft_cap_mod(cap),
                                      sliding_window=window, q_chunk=q_chunk, kv_chunk=kv_chunk)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_rows_close(got, want, qlens, msg=f"window={window} cap={cap} chunks={q_chunk, kv_chunk}")
    # The window given as a researcher's mask_mod (no chunk skipping) is the same function.
    hooked = blockwise_prefill_attention(q, k, v, tables, lens, qlens, 0.3, score_mod=soft_cap_mod(cap),
                                         mask_mod=window_mask_mod(window), q_chunk=q_chunk, kv_chunk=kv_chunk)
    assert_rows_close(hooked, want, qlens, msg="window as mask_mod")


@pytest.mark.parametrize("window,cap", [(None, None), (3, None), (None, 0.5), (5, 2.0)])
def test_reference_backend_prefill_matches_numpy_and_dense(window, cap):
    """The backend's prefill (the engine's CPU path) against the loop-per-query numpy oracle and dense_prefill."""
    q, k, v, tables, lens, qlens = random_case(2)
    spec = AttentionSpec(0.3, window, cap)
    meta = AttentionMetadata(slot_mapping=None, token_seq=None, block_tables=jnp.asarray(tables),
                             context_lens=jnp.asarray(lens), query_lens=jnp.asarray(qlens))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), meta, spec)
    want = numpy_attention(q, k, v, tables, lens, qlens, 0.3, window=window, cap=cap)
    assert_rows_close(REFERENCE.prefill(*args), want, qlens, atol=1e-5, msg="blockwise")
    assert_rows_close(REFERENCE.dense_prefill(*args), want, qlens, atol=1e-5, msg="dense")


def test_user_hooks_apply_per_tile_with_absolute_positions():
    """A score_mod / mask_mod that use the positions (not the shapes) give the reference's result."""
    q, k, v, tables, lens, qlens = random_batch(np.random.default_rng(11), S=3, H=4, KVH=2, D=8, block_size=4,
                                                max_len=60)
    score_mod = lambda s, qp, kp: s - 0.05 * (qp - kp).astype(jnp.float32)  # an ALiBi-like bias
    mask_mod = lambda qp, kp: (kp % 3) != 1  # drop every third key
    want = paged_attention_reference(q, k, v, tables, lens, qlens, 0.3, score_mod=score_mod, mask_mod=mask_mod)
    got = blockwise_prefill_attention(q, k, v, tables, lens, qlens, 0.3, score_mod=score_mod, mask_mod=mask_mod,
                                      q_chunk=8, kv_chunk=8)
    assert_rows_close(got, want, qlens)


def test_stale_slots_never_reach_the_output():
    """NaN in every cache slot past each context (freed blocks, the null block) leaves the output finite."""
    q, k, v, tables, lens, qlens = random_batch(np.random.default_rng(5), S=3, H=4, KVH=2, D=8, block_size=4,
                                                max_len=50)
    want = blockwise_prefill_attention(q, k, v, tables, lens, qlens, 0.3, q_chunk=8, kv_chunk=8)
    k, v = k.copy(), v.copy()
    used = np.zeros(k.shape[:2], bool)
    for s, n in enumerate(lens):
        pos = np.arange(n)
        used[tables[s, pos // 4], pos % 4] = True
    k[~used], v[~used] = np.nan, np.nan
    got = blockwise_prefill_attention(q, k, v, tables, lens, qlens, 0.3, q_chunk=8, kv_chunk=8)
    assert_rows_close(got, want, qlens, atol=0)


def test_chunks_before_the_window_are_not_read():
    """With sliding_window, a K/V chunk wholly before every query's window is skipped, not masked:
    NaN there (it would poison p @ v if read) does not reach the output."""
    S, Q, H, KVH, D, bs = 1, 8, 2, 1, 4, 4
    n = 64  # the last 8 positions are the queries; window 8 sees positions >= 49
    rng = np.random.default_rng(0)
    k = rng.normal(size=(n // bs + 1, bs, KVH, D)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    q = rng.normal(size=(S, Q, H, D)).astype(np.float32)
    tables = np.arange(1, n // bs + 1, dtype=np.int32)[None]
    lens, qlens = np.array([n], np.int32), np.array([Q], np.int32)
    want = paged_attention_reference(q, k, v, tables, lens, qlens, 0.5, mask_mod=window_mask_mod(8))
    v_nan = v.copy()
    v_nan[1:1 + 48 // bs] = np.nan  # positions 0..47: the six whole 8-token chunks before the window
    got = blockwise_prefill_attention(q, k, v_nan, tables, lens, qlens, 0.5, sliding_window=8, q_chunk=8,
                                      kv_chunk=8)
    assert_rows_close(got, want, qlens, atol=1e-6)


def _prefill_temp_bytes(backend_prefill, n: int, H=4, KVH=2, D=16, bs=16) -> int:
    """Scratch memory XLA plans for one n-token prompt through ``backend_prefill`` (compiled, not run)."""
    nb = n // bs + 1
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

    def f(q, k, v, tables, lens):
        meta = AttentionMetadata(slot_mapping=None, token_seq=None, block_tables=tables,
                                 context_lens=lens, query_lens=lens)
        return backend_prefill(q, k, v, meta, AttentionSpec(0.25))

    compiled = jax.jit(f).lower(f32(1, n, H, D), f32(nb, bs, KVH, D), f32(nb, bs, KVH, D), i32(1, n // bs),
                                i32(1)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_reference_prefill_memory_is_linear_in_the_prompt():
    """The reference backend's prefill (blockwise jnp: what "auto" runs on a CPU where the native
    kernel does not build, and what a decode + prefill backend's split step runs for query tiles)
    plans scratch memory that grows linearly with the prompt: far below one head's [prompt, prompt]
    float32 score matrix, and about flat from 1k to 4k tokens. The dense reference, for scale, grows
    4x per doubling. (The native ragged kernel plans none: its only XLA buffer is its output.)"""
    small, large = _prefill_temp_bytes(REFERENCE.prefill, 1024), _prefill_temp_bytes(REFERENCE.prefill, 4096)
    one_head_scores = 4096 * 4096 * 4
    assert large < one_head_scores / 4, (small, large)
    assert large < 2 * small, (small, large)
    dense_small, dense_large = (_prefill_temp_bytes(REFERENCE.dense_prefill, n) for n in (1024, 4096))
    assert dense_large > 10 * dense_small and dense_large > 4 * one_head_scores, (dense_small, dense_large)
