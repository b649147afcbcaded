"""The decode layout of attention equals the reference (one query per sequence)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import paged_attention_reference, paged_decode_attention


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 4), (8, 2, 16), (6, 1, 3)])
def test_decode_matches_reference(heads, kv_heads, block_size):
    rng = np.random.default_rng(heads * 7 + block_size)
    S, D, max_blocks, num_blocks = 5, 8, 6, 40
    k_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, D)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, D)), jnp.float32)
    tables = np.zeros((S, max_blocks), np.int32)
    lens = rng.integers(1, max_blocks * block_size + 1, S).astype(np.int32)
    lens[-1] = 0  # a padded row
    perm = rng.permutation(np.arange(1, num_blocks))
    for s in range(S):
        n = -(-int(lens[s]) // block_size)
        tables[s, :n], perm = perm[:n], perm[n:]
    q = jnp.asarray(rng.standard_normal((S, heads, D)), jnp.float32)
    got = paged_decode_attention(q, k_cache, v_cache, jnp.asarray(tables), jnp.asarray(lens), 0.3)
    want = paged_attention_reference(q[:, None], k_cache, v_cache, jnp.asarray(tables), jnp.asarray(lens),
                                      jnp.ones(S, jnp.int32), 0.3)[:, 0]
    np.testing.assert_allclose(np.asarray(got)[:-1], np.asarray(want)[:-1], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()
    # In groups of sequences (what large batches do): the same values.
    q8, t8, l8 = (jnp.concatenate([x, x[:3]]) for x in (q, jnp.asarray(tables), jnp.asarray(lens)))
    grouped = paged_decode_attention(q8, k_cache, v_cache, t8, l8, 0.3, tokens_per_group=1)
    np.testing.assert_allclose(np.asarray(grouped)[:5], np.asarray(got), rtol=1e-6, atol=1e-6)
