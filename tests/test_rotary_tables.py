"""The rotary embedding's cos and sin tables: computed once a step on a CPU, as written elsewhere.

XLA fuses an elementwise producer into its consumers: left alone, every rotary call (q and k in every
layer) evaluated cos and sin itself, for every head. ``rotary_tables`` puts them behind a conditional
on a CPU; these tests check that a function rotating q and k in 8 layers compiles to one evaluation of
them, that its values are numpy's rotate-half rotation, and that a GPU lowering keeps the plain tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.models.layers import apply_rope

T, HEADS, HEAD_DIM, LAYERS = 12, 4, 16, 8
INV_FREQ = 1.0 / (10000.0 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
ROPE = (INV_FREQ, None, None, 1.0, None)  # plain RoPE: no longrope set, no scaling, not dynamic


def rotate_layers(x, positions):
    """q and k of LAYERS layers rotated at the same positions, as a model's step does."""
    for _ in range(LAYERS):
        q, k = apply_rope(x, positions, ROPE), apply_rope(x + 1.0, positions, ROPE)
        x = q * 0.5 + k * 0.25
    return x


def numpy_rotate_layers(x, positions):
    freqs = positions.astype(np.float32)[:, None] * INV_FREQ[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    half = HEAD_DIM // 2

    def rope(v):
        return v * cos + np.concatenate([-v[..., half:], v[..., :half]], axis=-1) * sin

    for _ in range(LAYERS):
        x = rope(x) * 0.5 + rope(x + 1.0) * 0.25
    return x


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((T, HEADS, HEAD_DIM)).astype(np.float32),
            rng.integers(0, 4000, T).astype(np.int32))


def test_cpu_step_evaluates_the_tables_once_for_every_layer_and_head():
    x, positions = inputs()
    compiled = jax.jit(rotate_layers).lower(x, positions).compile()
    hlo = compiled.as_text()
    # One cos and one sin in each of the conditional's two (identical) branches; before, one in each of
    # the 16 rotary fusions.
    assert hlo.count(" cosine(") <= 2 and hlo.count(" sine(") <= 2, hlo
    got = np.asarray(compiled(x, positions))
    np.testing.assert_allclose(got, numpy_rotate_layers(x, positions), rtol=2e-5, atol=2e-5)


def test_gpu_lowering_keeps_the_plain_tables():
    x, positions = inputs()
    traced = jax.jit(rotate_layers).trace(jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                          jax.ShapeDtypeStruct(positions.shape, jnp.int32))
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    # Each lowering keeps its own platform's branch (a case on a constant, folded when compiling); the
    # CPU's holds the conditional and its predicate, the only reduction here (any NaN angle).
    assert "stablehlo.reduce" in cpu
    assert "stablehlo.reduce" not in cuda and "stablehlo.compare" not in cuda
