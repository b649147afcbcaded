"""The decode layout of attention equals the reference (one query per sequence)."""

from __future__ import annotations

import jax
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


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_writing_and_reading_the_cache_copies_no_whole_cache(tokens):
    """The KV cache is donated and updated in place: the compiled write + decode attention holds no
    copy of a whole cache (XLA:CPU copied both caches in every layer for a one-token write read back
    by attention, a second per batch-1 step of the GPT-2-124M shape without the native kernels)."""
    import re

    from paged_jax.attention import write_kv
    from paged_jax.attention.decode import paged_decode_attention

    def step(k_cache, v_cache, k, v, slots, q, tables, lens):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slots)
        return k_cache, v_cache, paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)

    cache = jax.ShapeDtypeStruct((64, 4, 2, 8), jnp.float32)
    rows = jax.ShapeDtypeStruct((tokens, 2, 8), jnp.float32)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(cache, cache, rows, rows, ints(tokens), rows,
                                                       ints(tokens, 3), ints(tokens)).compile().as_text()
    copies = [line for line in hlo.splitlines() if re.search(r"= f32\[(64,4,2,8|256,2,8)\]\{[^}]*\} copy\(", line)]
    assert not copies, copies
