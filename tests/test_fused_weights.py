"""Weights of one input stored as one (paged_jax/weights/fused.py): Q, K, V and gate, up panels
fused at load give every part's outputs bitwise as the parts' own calls, in one kernel call;
what cannot be fused stays apart; the runner's logits are bitwise those of unfused weights."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import native
from paged_jax.weights import DenseLinear, FusedLinear, fuse_inputs, project
from paged_jax.weights.fused import fusable
from paged_jax.weights.methods.on_load import quantize_weight
from paged_jax.weights.panels import to_panels
from tests.slow_cases import slow_unless

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")

FORMATS = [None, "int8", "int4", "int4-g128", "w8a8", "fp8"]


def _layer(rng, method, K=128, sizes=(96, 48, 40), bias=True):
    """A layer dict of q, k, v linears, packed (panels of 48 columns; the last part's padded)."""
    lp = {}
    for name, n in zip("qkv", sizes):
        w = DenseLinear(jnp.asarray(rng.standard_normal((K, n)).astype(np.float32) * 0.1),
                        jnp.asarray(rng.standard_normal(n).astype(np.float32)) if bias else None)
        lp[name] = w if method is None else quantize_weight(w, method)
    return to_panels(lp, int8=True, int4_int8=method == "int4")


@needs_native
@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize("M", slow_unless([1, 9], {9}))  # 9 rows: the panels' remainder rows too
def test_fused_panels_give_each_part_bitwise(method, M):
    rng = np.random.default_rng(M)
    parts = _layer(rng, method)
    fused = fuse_inputs(parts)
    assert set(fused) == {"q+k+v"} and isinstance(fused["q+k+v"], FusedLinear)
    assert fused["q+k+v"].sizes == (96, 48, 40)
    x = jnp.asarray(rng.standard_normal((M, 128)).astype(np.float32))
    want = jax.jit(lambda lp, x: project(x, lp, "q", "k", "v"))(parts, x)
    step = jax.jit(lambda lp, x: project(x, lp, "q", "k", "v"))
    got = step(fused, x)
    assert [g.shape for g in got] == [(M, 96), (M, 48), (M, 40)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # one kernel call where there were three
    hlo = step.lower(fused, x).as_text()
    assert hlo.count("custom_call") == 1, hlo.count("custom_call")


@needs_native
def test_fused_float32_against_numpy():
    """The fused call's parts against numpy's products of the unpacked weights (with biases)."""
    rng = np.random.default_rng(7)
    parts = _layer(rng, None)
    fused = fuse_inputs(parts)["q+k+v"]
    x = rng.standard_normal((2, 128)).astype(np.float32)
    for got, name in zip(fused(jnp.asarray(x)), "qkv"):
        p = parts[name]
        w = np.asarray(native.unpack_weight(p.panels))[:, :p.out_features].astype(np.float64)
        np.testing.assert_allclose(np.asarray(got), x @ w + np.asarray(p.b), rtol=1e-5, atol=1e-5)


def test_what_cannot_be_fused_stays_apart():
    rng = np.random.default_rng(3)
    parts = _layer(rng, None)
    # a part before the last with padding columns: its panels cannot lie side by side
    padded = _layer(rng, None, sizes=(40, 48, 48))
    widths = _layer(rng, None, sizes=(64, 48, 48))  # panels of 32 and of 48 columns
    # different formats, a bias on some parts only, a different input size
    mixed = {**_layer(rng, "int8"), "v": parts["v"]}
    half_bias = {**_layer(rng, None, bias=False), "v": parts["v"]}
    other_k = {**parts, "v": _layer(rng, None, K=96)["v"]}
    for lp in (padded, widths, mixed, half_bias, other_k):
        assert not fusable([lp[n] for n in "qkv"])
        assert set(fuse_inputs(lp)) == set("qkv")
    # a group with a part missing, or plain (unpacked) weights: nothing fused
    assert set(fuse_inputs({"q": parts["q"], "k": parts["k"]})) == {"q", "k"}
    dense = {n: DenseLinear(jnp.ones((8, 16), jnp.float32)) for n in "qkv"}
    assert set(fuse_inputs(dense)) == set("qkv")
    # the outputs through project are the same either way
    x = jnp.asarray(rng.standard_normal((2, 128)).astype(np.float32))
    out = project(x, padded, "q", "k", "v")
    assert [o.shape for o in out] == [(2, 40), (2, 48), (2, 48)]


@needs_native
def test_rows_past_the_quantized_limit_run_the_parts(monkeypatch):
    """Where a quantized call runs XLA's dequantize-then-matmul (rows past the build's limit),
    whose sums depend on the matrix's shape, the fused weight multiplies its parts one by one:
    bitwise the unfused outputs."""
    rng = np.random.default_rng(5)
    parts = _layer(rng, "int8")
    fused = fuse_inputs(parts)
    monkeypatch.setattr(native, "quantized_native_rows", lambda dtype: 4)
    step = jax.jit(lambda lp, x: project(x, lp, "q", "k", "v"))
    for M, calls, dots in ((4, 1, 0), (5, 0, 3)):
        x = jnp.asarray(rng.standard_normal((M, 128)).astype(np.float32))
        got, want = step(fused, x), step(parts, x)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        hlo = step.lower(fused, x).as_text()
        assert hlo.count("custom_call") == calls and hlo.count("stablehlo.dot_general") == dots


@needs_native
@pytest.mark.parametrize("quantization", [None, "int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_runner_logits_bitwise_with_fused_weights(tiny_llama_dir, quantization):
    """The runner's logits (prompt chunks and decode rows) with the loader's fused weights equal, to
    the bit, those of the same weights left apart."""
    from paged_jax.executor.batch import SeqChunk, prepare_batch
    from paged_jax.executor.loading import load_for_serving
    from paged_jax.executor.model_runner import ModelRunner
    prepare_module = sys.modules["paged_jax.weights.prepare"]  # (the package's `prepare` is the function)

    cfg, fused, _ = load_for_serving(str(tiny_llama_dir), "float32", 1, quantization=quantization)
    layer = fused["layers"][0]
    assert "q+k+v" in layer and "gate+up" in layer and "q" not in layer and "up" not in layer
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prepare_module, "fuse_inputs", lambda params: params)
        _, apart, _ = load_for_serving(str(tiny_llama_dir), "float32", 1, quantization=quantization)
    assert "q" in apart["layers"][0]
    batch = prepare_batch([SeqChunk([5, 9, 11, 3], 0, [1, 2]), SeqChunk([7], 6, [3, 4])], 4)
    got, want = (np.asarray(ModelRunner(cfg, p, 4, 8, 0).run_batch(batch, all_logits=True)) for p in (fused, apart))
    np.testing.assert_array_equal(got, want)
