"""Sliding window and logit soft-cap in the Pallas kernels (interpret mode) against the reference
with the same variant as its mask_mod / score_mod hooks, on ragged lengths and random block tables;
and through the "pallas-interpret" backend, where they come from the AttentionSpec."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import AttentionSpec, soft_cap_mod, window_mask_mod
from paged_jax.attention.reference import paged_attention_reference
from pallas_kernels.backend import PALLAS_INTERPRET
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from tests.test_pallas_kernels import TOL, make_case, run_backend
from tests.slow_cases import slow_unless


def reference(q, k, v, tables, lens, qlens, scale, window, cap):
    """q [S, Q, H, D]: the reference in float32 with the variant's hooks, at full float32 matmul
    precision (on a GPU the default is TF32, ~1e-3: above the float32 tolerance)."""
    f = lambda x: jnp.asarray(x, jnp.float32)
    with jax.default_matmul_precision("highest"):
        return np.asarray(paged_attention_reference(f(q), f(k), f(v), jnp.asarray(tables), jnp.asarray(lens),
                                                    jnp.asarray(qlens), scale, score_mod=soft_cap_mod(cap),
                                                    mask_mod=window_mask_mod(window)))


@functools.lru_cache(maxsize=None)
def decode_kernel(partition_size, window, cap):
    return jax.jit(functools.partial(paged_decode_attention, partition_size=partition_size, chunk_tokens=16,
                                     interpret=True, sliding_window=window, logit_soft_cap=cap))


@functools.lru_cache(maxsize=None)
def prefill_kernel(window, cap):
    return jax.jit(functools.partial(paged_prefill_attention, chunk_tokens=16, tile_rows=16, interpret=True,
                                     sliding_window=window, logit_soft_cap=cap))


# Windows shorter than a block, shorter than a 16-token chunk, spanning chunks, and wider than any context.
VARIANTS = [(1, None), (5, None), (20, None), (None, 0.5), (12, 2.0), (1000, 3.0)]


# windows of 5 and 1,000 (soft-capped): -m slow; 1 and 20 cover a window within and across blocks
@pytest.mark.parametrize("partition_size", [None, 16], ids=["single", "split16"])
@pytest.mark.parametrize("window,cap", slow_unless(VARIANTS, {1, 20, None, 12}))
def test_decode_window_and_soft_cap_match_reference(window, cap, partition_size):
    lens = [1, 7, 8, 29, 48, 0]  # one token, mid-block, on a block boundary, the maximum, a padded row
    q, k, v, tables, lens = make_case(sum(lens) + (window or 0), lens=lens, H=4, KVH=2, D=16, block_size=8,
                                      max_blocks=6, num_blocks=40, stale_tables=True)
    qlens = (lens > 0).astype(np.int32)
    got = np.asarray(decode_kernel(partition_size, window, cap)(q, k, v, tables, lens, 0.3))
    want = reference(q[:, None], k, v, tables, lens, qlens, 0.3, window, cap)[:, 0]
    assert np.isfinite(got).all() and not got[lens == 0].any()
    np.testing.assert_allclose(got[lens > 0], want[lens > 0], atol=1e-5, rtol=1e-5)
    if window is not None and window < 20:  # the variant changes the result here (so the check has teeth)
        plain = reference(q[:, None], k, v, tables, lens, qlens, 0.3, None, None)[:, 0]
        assert not np.allclose(plain[3:5], want[3:5], atol=1e-3)


@pytest.mark.parametrize("window,cap", VARIANTS)
def test_prefill_window_and_soft_cap_match_reference(window, cap):
    # Whole prompts, a chunk after a cached prefix, a single query, a padded row.
    lens, qlens = [40, 33, 9, 17, 0], [40, 9, 9, 1, 0]
    q, k, v, tables, lens = make_case(7 + (window or 0), lens=lens, H=4, KVH=1, D=16, block_size=4, max_blocks=10,
                                      num_blocks=40, Q=40, stale_tables=True)
    qlens = np.asarray(qlens, np.int32)
    got = np.asarray(prefill_kernel(window, cap)(q, k, v, tables, lens, qlens, 0.3))
    want = reference(q, k, v, tables, lens, qlens, 0.3, window, cap)
    assert np.isfinite(got).all() and not got[lens == 0].any()
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got[s, :n], want[s, :n], atol=1e-5, rtol=1e-5, err_msg=f"seq {s}")


# a 19-s random sweep: -m slow; the fixed cases above cover every variant by default
@pytest.mark.slow
def test_random_shapes_lengths_and_variants():
    """A seeded sweep: random shapes, lengths, tables, windows and caps, both kernels, three dtypes."""
    rng = np.random.default_rng(3)
    for trial, dtype in enumerate(["float32", "bfloat16", "float16"]):
        bs = int(rng.choice([1, 4, 8, 16]))
        mb = int(rng.integers(2, 5)) * max(1, 16 // bs)
        KVH = int(rng.choice([1, 2]))
        H = KVH * int(rng.choice([1, 3, 4]))
        S = int(rng.integers(2, 4))
        lens = [int(x) for x in rng.integers(1, mb * bs + 1, size=S)]
        qlens = [int(rng.integers(1, n + 1)) for n in lens]
        window, cap = int(rng.integers(1, mb * bs)), float(rng.choice([0.7, 5.0]))
        case = make_case(200 + trial, lens=lens, H=H, KVH=KVH, D=16, block_size=bs, max_blocks=mb,
                         num_blocks=S * mb + 2, Q=max(qlens), dtype=dtype, stale_tables=True)
        q, k, v, tables, lens = case
        spec = AttentionSpec(0.25, sliding_window=window, logit_soft_cap=cap)
        for Q in (1, max(qlens)):  # the decode kernel on each sequence's last query, then the prefill kernel
            qq = q[:, -1:] if Q == 1 else q
            ql = np.ones(S, np.int32) if Q == 1 else np.asarray(qlens, np.int32)
            got = np.asarray(jax.jit(lambda *a: run_backend(PALLAS_INTERPRET, *a, spec))(qq, k, v, tables, lens, ql)
                             .astype(jnp.float32))
            want = reference(qq, k, v, tables, lens, ql, 0.25, window, cap)
            for s, n in enumerate(ql):
                np.testing.assert_allclose(got[s, :n], want[s, :n], atol=TOL[dtype], rtol=TOL[dtype],
                                           err_msg=f"{dtype} Q={Q} seq {s} window {window} cap {cap}")
