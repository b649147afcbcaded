"""The int4 x int8 matmul (paged_jax/native/linear_int4.cc): symmetric 4-bit weights against
activations quantized to int8 per block of 32 in the kernel, as llama.cpp's q4_0 x q8_0. Checked
against a numpy oracle of that scheme (integer sums exact, float64 scaling), and its error against
float32's products stated; the AVX2 build is checked in test_native_linear.py's -mno-avx512f
subprocess (PORTABLE_CHECK), the portable loops in its slow one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import native
from paged_jax.weights import DenseLinear, PanelQuantizedLinear, prepare
from paged_jax.weights.panels import int4_int8_packable, to_panels
from tests.native_paths import native_paths_report  # noqa: F401 (autouse: the paths report)

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")


def q8_0_oracle(x, q, scales):
    """numpy's x @ (q * scales) the way llama.cpp multiplies q4_0 by q8_0: each row of ``x`` [M, K]
    per block of 32 as d = max|x| / 127 and round(x / d) (float32, ties to even), exact integer
    sums against ``q`` [K, N] (int, [-8, 7]) per block, scaled by d * the block's weight scale
    (``scales`` [G, N], groups of K / G rows) in float64."""
    M, K = x.shape
    xb = x.astype(np.float32).reshape(M, K // 32, 32)
    d = np.abs(xb).max(axis=-1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)
    sums = np.einsum("mbi,bin->mbn", xq, q.astype(np.int64).reshape(K // 32, 32, -1))
    dw = np.repeat(scales.astype(np.float64), K // scales.shape[0] // 32, axis=0)  # per block of 32 rows
    return (sums * (d[..., None].astype(np.float32) * dw[None].astype(np.float32)).astype(np.float64)).sum(axis=1)


def int4_case(rng, M, K, N, group):
    """Random q in [-8, 7] ([K, N]), scales per group of rows, the stored values ([K / 2, N] uint8, two
    to a byte plus 8) and x [M, K]."""
    q = rng.integers(-8, 8, size=(K, N))
    scales = rng.uniform(0.01, 0.1, size=(K // group, N)).astype(np.float32) * rng.choice([-1, 1], size=(K // group, N))
    u = (q + 8).astype(np.uint8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, :32] = 0  # an all-zero activation block: scale 0, values 0
    return q, scales, (u[0::2] | (u[1::2] << 4)).astype(np.uint8), x


@needs_native
@pytest.mark.parametrize("M", [1, 2, 9, 19])  # whole-panel rows, strips of 4 (AVX2) / 8 rows and their tails
@pytest.mark.parametrize("K,N,group", [(32, 16, 32), (128, 96, 32), (256, 80, 128), (512, 48, 64)])
def test_int4_by_int8_matches_the_q8_0_oracle(M, K, N, group):
    """The kernel equals the oracle of llama.cpp's scheme to float32 rounding (its error against the
    oracle below 1e-6 of the outputs' scale), and its error against float32 activations times the
    same 4-bit weight is the scheme's own: about 0.4 % of the outputs' largest magnitude (below 1.5 %)."""
    rng = np.random.default_rng(M * 1000 + K + N)
    q, scales, values, x = int4_case(rng, M, K, N, group)
    panels, scale_panels = native.pack_int4_blocks(jnp.asarray(values)), native.pack_padded(jnp.asarray(scales))
    got = np.asarray(jax.jit(native.linear_int4)(jnp.asarray(x), panels, scale_panels))[:, :N]
    want = q8_0_oracle(x, q, scales)
    top = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * top)
    assert not got[0].any() if K == 32 else True  # row 0's only block is all zeros
    exact = x.astype(np.float64) @ (q * np.repeat(scales, group, axis=0).astype(np.float64))
    assert np.abs(got - exact).max() <= 0.015 * np.abs(exact).max()


@needs_native
def test_one_and_two_rows_over_many_panels_equal_the_row_strips_to_the_bit():
    """One and two rows run over a panel's whole width at once (the weights read once), the panels
    shared between threads in ranges: over 37 panels every output column equals, to the bit, the
    same row of a 19-row product (register strips one vector wide), and the q8_0 oracle to float32
    rounding."""
    rng = np.random.default_rng(37)
    q, scales, values, x = int4_case(rng, 19, 256, 37 * 48, 32)
    panels, scale_panels = native.pack_int4_blocks(jnp.asarray(values)), native.pack_padded(jnp.asarray(scales))
    assert panels.shape[0] == 37
    run = jax.jit(native.linear_int4)
    strips = np.asarray(run(jnp.asarray(x), panels, scale_panels))
    want = q8_0_oracle(x, q, scales)
    np.testing.assert_allclose(strips, want, rtol=0, atol=1e-6 * np.abs(want).max())
    for first, rows in ((0, 1), (5, 2), (18, 1)):
        got = np.asarray(run(jnp.asarray(x[first:first + rows]), panels, scale_panels))
        np.testing.assert_array_equal(got, strips[first:first + rows])


def test_int4_blocks_roundtrip_and_xla_fallback():
    """pack_int4_blocks keeps every value (unpack_int4_blocks gives q back, padding columns 0), and
    the XLA fallback is x @ the dequantized weight, activations as they are; bad shapes are refused
    by name."""
    rng = np.random.default_rng(3)
    q, scales, values, x = int4_case(rng, 3, 64, 40, 32)
    panels = native.pack_int4_blocks(jnp.asarray(values))
    assert panels.shape == (1, 8, 48 * 4) and panels.dtype == jnp.uint8  # 40 columns padded to one 48-wide panel
    back = np.asarray(native.unpack_int4_blocks(panels))
    np.testing.assert_array_equal(back[:, :40], q)
    assert not back[:, 40:].any()
    got = np.asarray(native.linear_int4(jnp.asarray(x), panels, native.pack_padded(jnp.asarray(scales)), xla=True))
    w = q * np.repeat(scales, 32, axis=0).astype(np.float64)
    np.testing.assert_allclose(got[:, :40], x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 8"):
        native.pack_int4_blocks(jnp.zeros((3, 16), jnp.uint8))
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        native.linear_int4(jnp.zeros((1, 64), jnp.float32), panels, jnp.zeros((1, 4, 48), jnp.float32))


@needs_native
def test_on_load_int4_runs_the_integer_kernel_and_the_rest_keeps_float32():
    """quantization="int4" / "int4-g128" weights (symmetric, groups of 32 / 128) go to the int4 x
    int8 kernel, their products the q8_0 oracle's; the same weight packed as a W4A16 checkpoint's,
    int4 with zero points, groups of 16 or inputs not a multiple of 32 keep the float32 kernel (the
    activations as they are)."""
    from paged_jax.weights import QuantizedLinear
    from paged_jax.weights.methods.on_load import quantize_weight

    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 96)).astype(np.float32)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    for method, group in (("int4", 32), ("int4-g128", 128)):
        p = quantize_weight(DenseLinear(jnp.asarray(w)), method)
        assert int4_int8_packable(p)
        layer = prepare({"layers": [{"w": DenseLinear(jnp.asarray(w))}]}, "cpu", quantization=method)["layers"][0]["w"]
        assert isinstance(layer, PanelQuantizedLinear) and layer.int8_activations and layer.in_features == 256
        q = np.asarray(p.unpacked()).astype(np.int64)
        want = q8_0_oracle(x, q, np.asarray(p.scale))
        np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=0, atol=1e-6 * np.abs(want).max())
        float_layer = to_panels({"w": p})["w"]  # as a W4A16 checkpoint's: the float32 kernel, x as it is
        assert not float_layer.int8_activations
        np.testing.assert_allclose(np.asarray(float_layer(jnp.asarray(x))), x.astype(np.float64) @ np.asarray(p.dequantize()),
                                   rtol=1e-5, atol=1e-4)
    values = jnp.asarray(rng.integers(0, 256, size=(128, 48)).astype(np.uint8))
    scale = jnp.ones((4, 48), jnp.float32)
    for p in (QuantizedLinear(values, scale, zero=jnp.ones((4, 48), jnp.int8), bits=4, in_features_=256),
              QuantizedLinear(values, jnp.ones((16, 48), jnp.float32), bits=4, in_features_=256),
              QuantizedLinear(values[:20], jnp.ones((1, 48), jnp.float32), bits=4, in_features_=40)):
        assert not int4_int8_packable(p)
        assert not to_panels({"w": p}, int4_int8=True)["w"].int8_activations


@needs_native
@pytest.mark.slow
def test_bench_int4_call_compares_versions_bit_for_bit(tmp_path):
    """experiments/bench_int4_call.py builds other versions of the kernel beside the checkout's and
    times them only when their outputs equal the checkout's to the bit: the checkout's own source
    passes, one whose integer sums are off by one activation block's sum is refused by name."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = (root / "paged_jax" / "native" / "linear_int4.cc").read_text()
    off = tmp_path / "off.cc"
    off.write_text(source.replace("8 * a.s[", "7 * a.s["))
    assert off.read_text() != source
    cmd = [sys.executable, str(root / "experiments" / "bench_int4_call.py"), "--mb", "1", "--repeats", "1",
           "--cases", "fixed"]
    same = subprocess.run([*cmd, "--source", f"same={root / 'paged_jax' / 'native' / 'linear_int4.cc'}"],
                          capture_output=True, text=True, cwd=root)
    assert same.returncode == 0, same.stderr[-2000:]
    assert "| fixed: 2 panels, K 32 |" in same.stdout and "over the checkout" in same.stdout
    differs = subprocess.run([*cmd, "--source", f"off={off}"], capture_output=True, text=True, cwd=root)
    assert differs.returncode != 0 and "off differs from the checkout's kernel on fixed" in differs.stderr
