"""The native CPU matmul against panel-packed weights (paged_jax/native/linear.cc): a numpy
oracle, the packing, dispatch, and the runner's use of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import native
from paged_jax.models.layers import linear
from paged_jax.weights import DenseEmbedding, DenseLinear, PanelEmbedding, PanelLinear
from paged_jax.weights.panels import int8_packable, pack_int8, pack_quantized, quantized_packable, to_panels
from tests.native_paths import PORTABLE_FLAGS, native_paths_report, run_build  # noqa: F401 (autouse: the paths report)

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")


def _case(rng, M, K, N):
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    return x, w, x.astype(np.float64) @ w.astype(np.float64)


@needs_native
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 17, 64, 1030])  # register-tile tails, and past one 1024-row pass
@pytest.mark.parametrize("K,N", [(1, 16), (5, 32), (40, 48), (64, 96), (33, 80), (768, 2304), (24, 4096)])
def test_linear_matches_numpy(M, K, N):
    rng = np.random.default_rng(M * 1000 + K + N)
    x, w, ref = _case(rng, M, K, N)
    wp = native.pack_weight(jnp.asarray(w))
    assert wp.shape == (N // native.panel_width(N), K, native.panel_width(N))
    got = np.asarray(jax.jit(native.linear)(jnp.asarray(x), wp))
    assert got.shape == (M, N)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@needs_native
def test_linear_keeps_leading_dims_and_empty_rows():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 24)).astype(np.float32)
    w = rng.standard_normal((24, 32)).astype(np.float32)
    got = np.asarray(native.linear(jnp.asarray(x), native.pack_weight(w)))
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    assert native.linear(jnp.zeros((0, 24), jnp.float32), native.pack_weight(w)).shape == (0, 32)


def test_pack_unpack_roundtrip_and_panel_widths():
    w = np.arange(7 * 80, dtype=np.float32).reshape(7, 80)
    wp = native.pack_weight(w)
    assert native.panel_width(80) == 16 and wp.shape == (5, 7, 16)
    np.testing.assert_array_equal(np.asarray(wp[2]), w[:, 32:48])  # panel p holds columns p*W .. p*W+W-1
    np.testing.assert_array_equal(np.asarray(native.unpack_weight(wp)), w)
    assert [native.panel_width(n) for n in (48, 96, 64, 4096, 11008, 50257, 8)] == [48, 48, 32, 32, 32, None, None]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        native.pack_weight(np.ones((4, 50), np.float32))
    with pytest.raises(ValueError, match="x \\[..., K\\]"):
        native.linear(jnp.ones((2, 5), jnp.float32), native.pack_weight(np.ones((4, 16), np.float32)))
    with pytest.raises(ValueError, match="panels"):
        native.linear(jnp.ones((2, 4), jnp.float32), jnp.ones((4, 16), jnp.float32))


@needs_native
def test_dispatch_float32_native_else_xla():
    w = native.pack_weight(np.ones((16, 32), np.float32))
    f32 = jax.jit(native.linear).lower(jnp.ones((4, 16), jnp.float32), w).as_text()
    assert native.LINEAR_TARGET[0] in f32
    bf16 = jax.jit(native.linear).lower(jnp.ones((4, 16), jnp.bfloat16), w).as_text()
    assert native.LINEAR_TARGET[0] not in bf16 and "dot" in bf16
    # the model's linear: packed -> the kernel (bias added after), plain -> XLA's dot
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    wf = np.random.default_rng(3).standard_normal((16, 32)).astype(np.float32)
    b = np.arange(32, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(linear(x, PanelLinear(native.pack_weight(wf), b, out_features=32))),
                               np.asarray(linear(x, DenseLinear(wf, b))), rtol=1e-5, atol=1e-5)


@needs_native
def test_packed_weights_keep_the_kernel_when_native_is_switched_off_late(monkeypatch):
    """Packing is decided once: a step traced after ``PAGED_JAX_NATIVE=0`` on packed weights still
    calls the kernel, instead of unpacking the weights in every step."""
    w = native.pack_weight(np.ones((16, 32), np.float32))
    monkeypatch.setenv("PAGED_JAX_NATIVE", "0")
    text = jax.jit(native.linear).lower(jnp.ones((4, 16), jnp.float32), w).as_text()
    assert native.LINEAR_TARGET[0] in text and "transpose" not in text


def test_pack_params_packs_float32_linear_weights_by_type():
    rng = np.random.default_rng(4)
    params = {"embed": DenseEmbedding(jnp.asarray(rng.standard_normal((50, 32)), jnp.float32)),
              "lm_head": DenseLinear(jnp.asarray(rng.standard_normal((32, 50)), jnp.float32), parallel="column"),
              "final_ln": {"w": jnp.ones((32, 48), jnp.float32), "b": jnp.zeros(32)},  # not a weight object
              "layers": [{"qkv": DenseLinear(jnp.ones((32, 96), jnp.float32), jnp.zeros(96)),
                          "half": DenseLinear(jnp.ones((32, 64), jnp.bfloat16))}]}
    packed = to_panels(params)
    layer = packed["layers"][0]
    assert isinstance(layer["qkv"], PanelLinear) and layer["qkv"].panels.shape == (2, 32, 48)
    assert layer["qkv"].b is params["layers"][0]["qkv"].b
    assert layer["half"] is params["layers"][0]["half"]  # bfloat16: left to XLA
    assert packed["embed"] is params["embed"]  # untied: the table serves lookups only
    head = packed["lm_head"]
    assert isinstance(head, PanelLinear) and head.parallel == "column" and head.out_features == 50
    assert head.panels.shape == (2, 32, 48)  # the vocabulary of 50 padded to 96 with zero columns
    np.testing.assert_array_equal(np.asarray(native.unpack_weight(head.panels))[:, :50],
                                  np.asarray(params["lm_head"].w))
    assert not np.asarray(head.panels)[1, :, 2:].any()
    h = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    np.testing.assert_allclose(np.asarray(head(h)), np.asarray(params["lm_head"](h)), rtol=1e-5, atol=1e-5)
    assert packed["final_ln"]["w"] is params["final_ln"]["w"]
    assert isinstance(params["layers"][0]["qkv"], DenseLinear)  # the input is not changed


def _packed_layers(runner) -> bool:
    return any(isinstance(p, PanelLinear) for p in runner.params["layers"][0].values())


@pytest.mark.skipif(not native.packs_weights(), reason="float32 weights stay with XLA here (no AVX-512, or AVX2 on an AVX-512 CPU)")
def test_runner_packs_on_cpu_and_step_matches_xla(tiny_llama_dir, monkeypatch):
    """The runner's step with packed weights gives the logits of the same step with XLA's
    matmuls (native switched off), on prompts and decode rows."""
    from paged_jax.executor.batch import SeqChunk, prepare_batch
    from paged_jax.executor.model_runner import ModelRunner
    from paged_jax.executor.loading import load_for_serving

    cfg, params, _ = load_for_serving(str(tiny_llama_dir), "float32", 1)
    chunks = [SeqChunk([5, 9, 11, 3], 0, [1, 2]), SeqChunk([7], 6, [3, 4])]
    batch = prepare_batch(chunks, 4)

    def logits(runner):
        return np.asarray(runner.run_batch(batch, all_logits=True))

    packed = ModelRunner(cfg, params, 4, 8, 0)
    assert _packed_layers(packed)
    got = logits(packed)
    monkeypatch.setenv("PAGED_JAX_NATIVE", "0")
    _, params, _ = load_for_serving(str(tiny_llama_dir), "float32", 1, native_kernels=False)
    plain = ModelRunner(cfg, params, 4, 8, 0)
    assert not _packed_layers(plain)
    np.testing.assert_allclose(got, logits(plain), rtol=1e-4, atol=1e-4)


@needs_native
def test_read_sum_matches_numpy():
    x = np.random.default_rng(5).standard_normal(100_003).astype(np.float32)  # not a multiple of 16
    np.testing.assert_allclose(float(jax.jit(native.read_sum)(jnp.asarray(x))), x.astype(np.float64).sum(),
                               rtol=1e-5, atol=1e-3)
    assert float(native.read_sum(jnp.ones((3, 5), jnp.float32))) == 15.0
    assert float(native.read_sum(jnp.zeros((0,), jnp.float32))) == 0.0
    with pytest.raises(ValueError, match="float32"):
        native.read_sum(jnp.ones(4, jnp.bfloat16))


def test_tied_embedding_packed_once_serves_lookup_and_logits():
    rng = np.random.default_rng(6)
    embed = jnp.asarray(rng.standard_normal((53, 16)), jnp.float32)  # V = 53: padded to 96
    dense = {"embed": DenseEmbedding(embed, tied=True)}
    packed = to_panels(dense)
    assert isinstance(packed["embed"], PanelEmbedding) and packed["embed"].panels.shape == (2, 16, 48)
    ids = jnp.asarray([0, 47, 48, 52, 5, -1, -53, 53, 95, 400, -400])  # and outside [0, V): as embed[ids]
    np.testing.assert_array_equal(np.asarray(packed["embed"].lookup(ids)), np.asarray(embed[ids]))
    h = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    got = np.asarray(packed["embed"].logits(h))
    assert got.shape == (3, 53)
    np.testing.assert_allclose(got, np.asarray(dense["embed"].logits(h)), rtol=1e-5, atol=1e-5)


PORTABLE_CHECK = r"""
import json, numpy as np, jax, jax.numpy as jnp
from paged_jax import native
from paged_jax.weights import QuantizedLinear
from paged_jax.weights.panels import pack_int8, pack_quantized
assert native.available(), native.status()
rng = np.random.default_rng(0)
errs = []
for M, K, N in [(1, 16, 16), (9, 40, 96), (33, 70, 32)]:
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    got = np.asarray(native.linear(jnp.asarray(x), native.pack_weight(w)))
    errs.append(float(np.abs(got - x.astype(np.float64) @ w).max()))
    # the int8 x int8 matmul: exact integer sums, scaled once (compared with numpy's)
    xq = rng.integers(-128, 128, size=(M, 4 * K)).astype(np.int8)
    wq = rng.integers(-128, 128, size=(4 * K, N)).astype(np.int8)
    xs, ws = rng.uniform(0.01, 0.1, size=(M, 1)).astype(np.float32), rng.uniform(0.01, 0.1, size=(1, N)).astype(np.float32)
    p = QuantizedLinear(jnp.asarray(wq), jnp.asarray(ws), in_features_=4 * K, act="int8")
    got = np.asarray(native.linear_int8(jnp.asarray(xq), jnp.asarray(xs), *pack_int8(p)))[:, :N]
    want = (xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.float32) * xs * ws
    errs.append(float(np.abs(got - want).max()))
# quantized weights (int8, int4 with zero points, fp8) against XLA's dequantizing matmul, 1 and 12 rows
tiles_equal = []
# (int8 with one scale per column: its sums scaled once; the others in 2 groups, each weight scaled)
for values, bits, groups in [(rng.integers(-128, 128, size=(64, 48)).astype(np.int8), 8, 1),
                             (rng.integers(0, 256, size=(32, 48)).astype(np.uint8), 4, 2),
                             (jnp.asarray(rng.standard_normal((64, 48)) * 8, dtype=jnp.float8_e4m3fn), 8, 2)]:
    scale = jnp.asarray(rng.uniform(0.01, 0.1, size=(groups, 48)).astype(np.float32))
    zero = jnp.asarray(rng.integers(-8, 8, size=(2, 48)).astype(np.int8)) if bits == 4 else None
    p = QuantizedLinear(jnp.asarray(values), scale, zero=zero, bits=bits, in_features_=64)
    panels, scales, zeros, _ = pack_quantized(p)
    for M in (1, 12):
        x = jnp.asarray(rng.standard_normal((M, 64)).astype(np.float32))
        got = np.asarray(native.linear_quantized(x, panels, scales, bits, zeros))[:, :48]
        errs.append(float(np.abs(got - np.asarray(x @ p.dequantize())).max()))
    # register tiles of 1 to 8 rows (one tile: 7 and 8 rows in 8-column strips) equal to the bit the
    # same rows of a 12-row product (float32 slabs)
    x = jnp.asarray(rng.standard_normal((12, 64)).astype(np.float32))
    slabs = np.asarray(native.linear_quantized(x, panels, scales, bits, zeros))
    tiles_equal.append([bool((np.asarray(native.linear_quantized(x[:M], panels, scales, bits, zeros)) == slabs[:M]).all())
                        for M in range(1, 9)])
# int4 x int8 (activations quantized per block of 32 in the kernel): relative to q8_0's numpy oracle
from tests.test_native_int4 import int4_case, q8_0_oracle
int4_errs = []
for M in (1, 2, 6):
    q, sc, vals, x = int4_case(rng, M, 128, 96, 64)
    got = np.asarray(native.linear_int4(jnp.asarray(x), native.pack_int4_blocks(jnp.asarray(vals)),
                                        native.pack_padded(jnp.asarray(sc))))[:, :96]
    want = q8_0_oracle(x, q, sc)
    int4_errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
print(json.dumps({"errs": errs, "int4_errs": int4_errs, "tiles_equal": tiles_equal, "status": native.status(),
                  "packs_weights": native.packs_weights()}))
"""


@needs_native
def test_avx2_paths_without_avx512(tmp_path_factory):
    """The matmuls' AVX2 + FMA3 tiles (built with -mno-avx512f, in its own process: on an AVX-512
    CPU, that CPU with AVX-512 turned off) give the same products: float32, int8 / int4 / fp8
    weights, and int8 x int8 (vpmaddwd, no VNNI); float32 weights go to them only on a CPU without
    AVX-512."""
    out = run_build(PORTABLE_CHECK, tmp_path_factory, "test_native_linear.py::test_avx2_paths_without_avx512")
    assert len(out["errs"]) == 12 and max(out["errs"]) < 1e-3, out["errs"]
    assert len(out["int4_errs"]) == 3 and max(out["int4_errs"]) < 1e-6, out["int4_errs"]
    assert out["tiles_equal"] == [[True] * 8] * 3, out["tiles_equal"]  # int8, int4, fp8: 1 to 8 rows
    assert {"linear float32", "linear int8", "linear int4", "linear fp8",
            "linear int8 x int8", "linear int4 x int8"} <= set(out["status"]["traced"])
    avx2 = "avx2" in native.cpu_isa()
    paths = out["status"]["paths"]
    assert [paths["linear float32"], paths["linear quantized"], paths["linear int8 x int8"],
            paths["linear int4 x int8"]] == ["avx2" if avx2 else "portable"] * 4
    # float32 weights go to the AVX2 tiles on a CPU with only AVX2; an AVX-512 CPU's XLA beats them
    # (its float32 dots still run AVX-512 kernels; bench_isa_decode.py)
    assert out["packs_weights"] is (avx2 and "avx512f" not in native.cpu_isa())
    # quantized steps past so many rows go to XLA's dequantize-then-matmul there
    assert out["status"]["quantized_native_rows"] == (LIMITS_ON_AN_AVX2_CPU if "avx512f" not in native.cpu_isa()
                                                      else LIMITS_ON_AN_AVX512_CPU)


@needs_native
@pytest.mark.slow
def test_portable_loops_without_avx2(tmp_path_factory):
    """The portable loops (built with -mno-avx512f -mno-avx2 -mno-fma) give the same products;
    the runner keeps XLA's float32 matmuls there (the loops are slower)."""
    out = run_build(PORTABLE_CHECK, tmp_path_factory, "test_native_linear.py::test_portable_loops_without_avx2",
                    PORTABLE_FLAGS)
    assert len(out["errs"]) == 12 and max(out["errs"]) < 1e-3, out["errs"]
    assert len(out["int4_errs"]) == 3 and max(out["int4_errs"]) < 1e-6, out["int4_errs"]
    assert set(out["status"]["paths"].values()) == {"portable"}
    assert out["packs_weights"] is False


@needs_native
def test_isa_paths_where_the_cpu_has_them(monkeypatch, tiny_llama_dir):
    """The default build uses AVX-512 (VNNI for the int8 x int8 matmul) exactly where the CPU has it,
    else AVX2 where it has that, in every matmul; a runner packs float32 weights with AVX-512, or with
    AVX2 on a CPU without AVX-512."""
    from paged_jax.executor.model_runner import ModelRunner
    from paged_jax.executor.loading import load_for_serving

    isa = native.cpu_isa()
    off = "-mno-avx512f" in native.build._flags()  # PAGED_JAX_NATIVE_FLAGS: this CPU's AVX2 paths, on purpose
    has = "avx512f" in isa and not off
    linear = "avx512" if has else "avx2" if "avx2" in isa else "portable"
    int8 = "vnni" if has and "avx512_vnni" in isa else "avx2" if "avx2" in isa else "portable"
    assert native.paths() == {"attention": linear, "linear float32": linear,
                              "linear quantized": linear, "linear int8 x int8": int8, "linear int4 x int8": int8}
    assert native.packs_weights() == (linear == "avx512" or (linear == "avx2" and "avx512f" not in isa))
    assert native.status()["quantized_native_rows"] == (
        dict.fromkeys(LIMITS_ON_AN_AVX2_CPU) if linear == "avx512" else
        LIMITS_ON_AN_AVX2_CPU if linear == "avx2" and "avx512f" not in isa else LIMITS_ON_AN_AVX512_CPU)
    monkeypatch.setitem(native._state, "linear_isa", 0)  # as on a CPU with neither
    cfg, params, _ = load_for_serving(str(tiny_llama_dir), "float32", 1)
    runner = ModelRunner(cfg, params, 4, 8, 0)
    assert not _packed_layers(runner)


def _quantized(rng, K, N, bits, groups, per_tensor=False, zero=False, act_order=False):
    """A QuantizedLinear of random int8 / int4 values, its scales (zero points, activation-order
    ``g_idx`` when asked) and its float weight (numpy, float64)."""
    from paged_jax.weights.quantized import pack_nibbles
    from paged_jax.weights import QuantizedLinear

    top = 1 << (bits - 1)
    q = rng.integers(-top, top, size=(K, N)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, size=(groups, 1 if per_tensor else N)).astype(np.float32)
    zeros = rng.integers(-top, top, size=scale.shape).astype(np.int8) if zero else None
    g_idx = rng.permutation(np.arange(K) // (K // groups)).astype(np.int32) if act_order else None
    values = pack_nibbles(q) if bits == 4 else q
    p = QuantizedLinear(jnp.asarray(values), jnp.asarray(scale), zero=None if zeros is None else jnp.asarray(zeros),
                        g_idx=None if g_idx is None else jnp.asarray(g_idx), bits=bits, in_features_=K,
                        block=(K // groups, N if per_tensor else 1))
    rows = np.arange(K) // (K // groups) if g_idx is None else g_idx  # the scale row of each weight row
    w = q.astype(np.float64)
    if zeros is not None:
        w = w - zeros[rows].astype(np.float64)
    return p, w * scale[rows].astype(np.float64)


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("M", [1, 8, 33])  # register tiles up to 8 rows; slabs: 8-row tiles and a tail
@pytest.mark.parametrize("K,N,groups,per_tensor", [(64, 96, 1, False), (128, 80, 4, False), (256, 48, 2, False),
                                                   (32, 16, 1, True), (384, 32, 3, False)])
@pytest.mark.parametrize("zero,act_order", [(False, False), (True, True)])
def test_quantized_linear_matches_numpy(bits, M, K, N, groups, per_tensor, zero, act_order):
    """Register tiles (up to 8 rows) and float32 slabs (more rows; K 384 is three slabs), with and
    without zero points and activation order, against numpy and against XLA's dequantizing matmul."""
    if act_order and groups == 1:
        pytest.skip("one group: activation order changes nothing")
    rng = np.random.default_rng(M * 100 + K + N + bits)
    p, w = _quantized(rng, K, N, bits, groups, per_tensor, zero, act_order)
    assert quantized_packable(p)
    x = rng.standard_normal((M, K)).astype(np.float32)
    panels, scales, zeros, order = pack_quantized(p)
    assert (zeros is not None) == zero and (order is not None) == act_order
    xs = jnp.asarray(x if order is None else x[:, np.asarray(order)])
    got = np.asarray(jax.jit(native.linear_quantized, static_argnums=3)(xs, panels, scales, bits, zeros))
    np.testing.assert_allclose(got[:, :N], x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    # the same weight through XLA (QuantizedLinear's own matmul) agrees
    np.testing.assert_allclose(np.asarray(p(jnp.asarray(x))), got[:, :N], rtol=1e-5, atol=1e-5 * np.sqrt(K))


@needs_native
@pytest.mark.parametrize("M", [1, 8, 33])  # register tiles, slabs
@pytest.mark.parametrize("scales", ["tensor", "column", "block"])
@pytest.mark.parametrize("act", [None, "fp8"])
def test_fp8_weights_match_numpy(M, scales, act):
    """fp8 e4m3 weights (every code but NaN, subnormals included) per tensor, per column and in
    32 x 32 blocks, with float or fp8 activations (rounded per token first, as QuantizedLinear
    does), against numpy's decoding of the codes and XLA's dequantizing matmul."""
    import ml_dtypes

    from paged_jax.weights import QuantizedLinear, quantize_per_token

    rng = np.random.default_rng(M)
    K, N = 256, 80
    codes = rng.integers(0, 256, size=(K, N)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN
    codes[0, :N] = np.arange(N, dtype=np.uint8)  # small codes: zero and the subnormals
    values = codes.view(ml_dtypes.float8_e4m3fn)
    shape, block = {"tensor": ((1, 1), (K, N)), "column": ((1, N), (K, 1)), "block": ((K // 32, 3), (32, 32))}[scales]
    scale = rng.uniform(0.01, 0.1, size=shape).astype(np.float32)
    p = QuantizedLinear(jnp.asarray(values), jnp.asarray(scale), in_features_=K, block=block, act=act)
    assert quantized_packable(p)
    full = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:K, :N].astype(np.float64)
    w = values.astype(np.float64) * full
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    xr = x if act is None else (lambda q, s: q.astype(jnp.float32) * s)(*quantize_per_token(x, act))
    packed = to_panels({"w": p})["w"]
    got = np.asarray(jax.jit(packed.__call__)(x))
    np.testing.assert_allclose(got, np.asarray(xr, np.float64) @ w, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    np.testing.assert_allclose(got, np.asarray(p(x)), rtol=1e-5, atol=1e-5 * np.sqrt(K))


@needs_native
@pytest.mark.parametrize("groups", [1, 2])  # one scale per column: the sums scaled once (no zero points)
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_register_tiles_and_float_slabs_agree_to_the_bit(fmt, groups):
    """Rows 0, 0-1, 0-3, 0-6 and 0-7 of a 12-row product (float32 slabs) equal the same rows run
    alone (register tiles of 1, 2, 4, 7 and 8 rows; with AVX-512 the tiles of 1 and 2 rows run two of
    the three 48-column panels at once, and the third alone)."""
    from paged_jax.weights import QuantizedLinear

    rng = np.random.default_rng(len(fmt))
    if fmt == "fp8":
        values = jnp.asarray(rng.standard_normal((256, 144)) * 8, dtype=jnp.float8_e4m3fn)
        scale = jnp.asarray(rng.uniform(0.01, 0.1, (groups, 144)).astype(np.float32))
        p = QuantizedLinear(values, scale, in_features_=256)
    else:  # int4 in 2 groups with zero points
        p, _ = _quantized(rng, 256, 144, 8 if fmt == "int8" else 4, groups, zero=fmt == "int4" and groups == 2)
    panels, scales, zeros, _ = pack_quantized(p)
    x = jnp.asarray(rng.standard_normal((12, 256)).astype(np.float32))
    f = jax.jit(native.linear_quantized, static_argnums=3)
    slabs = np.asarray(f(x, panels, scales, p.bits, zeros))
    assert panels.shape[0] == 3
    for M in (1, 2, 4, 7, 8):
        np.testing.assert_array_equal(slabs[:M], np.asarray(f(x[:M], panels, scales, p.bits, zeros)))


@needs_native
def test_pack_params_packs_the_quantized_weights_the_kernel_takes_and_leaves_the_rest():
    from paged_jax.weights import PanelQuantizedLinear, QuantizedLinear

    rng = np.random.default_rng(5)
    p8, _ = _quantized(rng, 64, 32, 8, 2)
    p4, _ = _quantized(rng, 64, 40, 4, 4)
    fp8 = QuantizedLinear(jnp.asarray(rng.standard_normal((64, 32)), dtype=jnp.float8_e4m3fn),
                          jnp.ones((1, 32)), in_features_=64, bits=4)  # values that contradict the bits
    w8a8 = QuantizedLinear(p8.values, p8.scale, in_features_=64, act="int8")  # groups: float32 after rounding x
    asym, _ = _quantized(rng, 64, 32, 4, 2, zero=True, act_order=True)
    uneven = QuantizedLinear(asym.values, asym.scale, zero=asym.zero, g_idx=jnp.zeros(64, jnp.int32), bits=4,
                             in_features_=64, block=(32, 1))  # one group of 64 rows, one of none
    weights = {"a": p8, "b": p4, "c": fp8, "d": w8a8, "e": asym, "f": uneven}
    packed = to_panels(weights)
    assert all(isinstance(packed[k], PanelQuantizedLinear) for k in "abde")
    assert packed["b"].panels.dtype == jnp.uint8 and packed["b"].out_features == 40
    assert packed["e"].zeros is not None and packed["e"].order is not None and packed["d"].act == "int8"
    assert all(packed[k] is weights[k] for k in "cf")
    x = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    for k in "abde":
        np.testing.assert_allclose(np.asarray(packed[k](x)), np.asarray(weights[k](x)), rtol=1e-5, atol=1e-4)


# The row limits by CPU, as measured (paged_jax/native/build.py): an AVX-512 CPU running a build
# without it, and a CPU with only AVX2. With AVX-512 built in: the kernel at every row count.
LIMITS_ON_AN_AVX512_CPU = {"int8": None, "int4": 64, "fp8": 32, "int4 x int8": 64}
LIMITS_ON_AN_AVX2_CPU = {"int8": None, "int4": 256, "fp8": 256, "int4 x int8": None}


@needs_native
@pytest.mark.parametrize("cpu", ["avx512 cpu", "avx2 cpu"])
@pytest.mark.parametrize("kernel", ["int8", "int4", "fp8", "int4 x int8"])
def test_quantized_steps_past_the_row_limit_run_xla_without_avx512(monkeypatch, kernel, cpu):
    """Without AVX-512 built in (a build's linear path, set here as an AVX2 build reports it) a
    quantized layer gives its native kernel steps of up to the kernel's row limit on this CPU and
    XLA's dequantize-then-matmul the longer ones (int8, and the int4 x int8 kernel on a CPU with only
    AVX2: the kernel at every row count); with AVX-512, the kernel at every row count. Both equal
    numpy's product (the int4 x int8 kernel: llama.cpp's q8_0 x q4_0 scheme)."""
    from paged_jax.weights import QuantizedLinear
    from tests.test_native_int4 import q8_0_oracle

    limit = (LIMITS_ON_AN_AVX512_CPU if cpu == "avx512 cpu" else LIMITS_ON_AN_AVX2_CPU)[kernel]
    rng = np.random.default_rng(len(kernel) + len(cpu))
    if kernel == "fp8":
        values = jnp.asarray(rng.standard_normal((64, 48)) * 8, dtype=jnp.float8_e4m3fn)
        scale = rng.uniform(0.01, 0.1, (2, 48)).astype(np.float32)
        p = QuantizedLinear(values, jnp.asarray(scale), in_features_=64)
        w = np.asarray(values, np.float64) * np.repeat(scale, 32, axis=0)
    elif kernel == "int4 x int8":
        p, w = _quantized(rng, 64, 48, 4, 2)
        q = np.rint(w / np.repeat(np.asarray(p.scale, np.float64), 32, axis=0)).astype(np.int64)
    else:
        p, w = _quantized(rng, 64, 48, 8 if kernel == "int8" else 4, 2, zero=True)
    packed = to_panels({"w": p}, int4_int8=kernel == "int4 x int8")["w"]
    assert packed.kernel == kernel
    target = (native.INT4_TARGET if kernel == "int4 x int8" else native.QUANTIZED_TARGETS[packed.panels.dtype.name])[0]
    rows = [1, limit or 16, (limit or 16) + 1, 300]
    monkeypatch.setattr(native.build, "cpu_isa", lambda: ["avx2", "fma"] + ["avx512f"] * (cpu == "avx512 cpu"))
    for isa, kernel_rows in ((1, rows[:2] if limit else rows), (2, rows)):
        monkeypatch.setitem(native._state, "linear_isa", isa)
        for M in rows:
            x = rng.standard_normal((M, 64)).astype(np.float32)
            text = jax.jit(packed.__call__).lower(jnp.asarray(x)).as_text()
            assert (target in text) == (M in kernel_rows), (isa, M)
            got = np.asarray(jax.jit(packed.__call__)(jnp.asarray(x)))
            if kernel == "int4 x int8" and M in kernel_rows:
                want = q8_0_oracle(x, q, np.asarray(p.scale))
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
            else:
                np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5 * np.sqrt(64))
    monkeypatch.setitem(native._state, "linear_isa", 1)
    assert native.status()["quantized_native_rows"] == (LIMITS_ON_AN_AVX512_CPU if cpu == "avx512 cpu" else
                                                        LIMITS_ON_AN_AVX2_CPU)


def test_quantized_native_rows_names_the_kernels():
    with pytest.raises(ValueError, match=r"one of \[.*'int4 x int8'\], got 'uint8'"):
        native.quantized_native_rows("uint8")


def _w8a8(rng, K, N, per_tensor=False):
    from paged_jax.weights import QuantizedLinear

    wq = rng.integers(-128, 128, size=(K, N)).astype(np.int8)
    ws = rng.uniform(0.01, 0.1, size=(1, 1 if per_tensor else N)).astype(np.float32)
    return QuantizedLinear(jnp.asarray(wq), jnp.asarray(ws), in_features_=K, act="int8",
                           block=(K, N if per_tensor else 1)), wq, ws


@needs_native
@pytest.mark.parametrize("M", [3, 9, 1030])  # a tail tile; 8-row tiles and a tail; two row passes
@pytest.mark.parametrize("K,N,per_tensor", [(4, 16, False), (64, 96, False), (132, 80, False), (512, 48, True)])
def test_int8_by_int8_linear_matches_numpy_and_xla_to_the_bit(M, K, N, per_tensor):
    """W8A8: int8 activations (extremes included: -128 and 127) times int8 weights, exact integer
    sums scaled once; equal to numpy's integer product and bitwise to QuantizedLinear's XLA path."""
    rng = np.random.default_rng(M + K + N)
    p, wq, ws = _w8a8(rng, K, N, per_tensor)
    assert int8_packable(p)
    xq = rng.integers(-128, 128, size=(M, K)).astype(np.int8)
    xq[0, :2] = [-128, 127]
    xs = rng.uniform(0.01, 0.1, size=(M, 1)).astype(np.float32)
    got = np.asarray(jax.jit(native.linear_int8)(jnp.asarray(xq), jnp.asarray(xs), *pack_int8(p)))[:, :N]
    np.testing.assert_array_equal(got, (xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.float32) * xs * ws)
    # the whole layer (activations quantized per token) against QuantizedLinear's own int8 dot
    from paged_jax.weights import PanelInt8Linear

    panels, sums, scales = pack_int8(p)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    packed = PanelInt8Linear(panels, sums, scales, out_features=N)
    np.testing.assert_array_equal(np.asarray(jax.jit(packed.__call__)(x)), np.asarray(jax.jit(p.__call__)(x)))


@needs_native
def test_pack_params_packs_w8a8_only_where_an_integer_kernel_runs_it():
    from paged_jax.weights import PanelInt8Linear, PanelQuantizedLinear, QuantizedLinear

    rng = np.random.default_rng(3)
    p, _, _ = _w8a8(rng, 64, 32)
    odd = QuantizedLinear(p.values[:62], p.scale, in_features_=62, act="int8")  # inputs not a multiple of 4
    grouped = QuantizedLinear(p.values, jnp.ones((2, 32)), in_features_=64, act="int8", block=(32, 1))
    packed = to_panels({"a": p, "odd": odd, "grouped": grouped})
    assert isinstance(packed["a"], PanelInt8Linear) == (native.paths()["linear int8 x int8"] != "portable")
    assert packed["odd"] is odd  # XLA's integer dot
    # scales per group: not an integer matmul, QuantizedLinear multiplies the rounded activations in float32
    assert isinstance(packed["grouped"], PanelQuantizedLinear) and packed["grouped"].act == "int8"


def _q4_0(w, group):
    """numpy's llama.cpp q4_0 of ``w [K, N]`` along K: in each group of each column the weight of
    largest magnitude m gives the scale m / -8, the rest round(w / scale) clipped to [-8, 7];
    returns (the dequantized weight, the scales repeated per row)."""
    K, N = w.shape
    g = w.reshape(K // group, group, N).astype(np.float32)
    m = np.take_along_axis(g, np.abs(g).argmax(axis=1)[:, None], axis=1)
    d = np.where(m == 0, np.float32(1), m / np.float32(-8))
    q = np.clip(np.round(g / d), -8, 7)
    return (q * d).reshape(K, N), np.repeat(d[:, 0], group, axis=0)


@pytest.mark.parametrize("method,K,group", [("int4", 128, 32), ("int4-g128", 256, 128), ("int4", 40, 40)])
def test_int4_on_load_is_q4_0_and_runs_on_the_kernel(method, K, group):
    """quantization="int4" / "int4-g128": each group of rows (or the whole column, where 32 does not
    divide the inputs) as numpy's q4_0; the layer's products (the native kernel where built, XLA's
    dequantizing matmul otherwise) equal x @ that weight; unknown methods are refused by name."""
    from paged_jax.weights import QuantizedLinear
    from paged_jax.weights.methods.on_load import quantize_layers

    rng = np.random.default_rng(K)
    w = rng.standard_normal((K, 48)).astype(np.float32)
    w[5, 3] = 0
    w[:group, 7] = 0  # an all-zero group
    params = quantize_layers({"layers": [{"w": DenseLinear(jnp.asarray(w))}]}, method)
    q = params["layers"][0]["w"]
    assert isinstance(q, QuantizedLinear) and q.bits == 4 and q.values.shape == (K // 2, 48)
    assert q.scale.shape == (K // group, 48)
    want, d = _q4_0(w, group)
    got = np.asarray(q.dequantize())
    # XLA may divide by the scale as a multiply by its reciprocal: a weight on a .5 can round the
    # other way (one level); every other weight is numpy's
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 + 1.0001 * np.abs(d).max())
    assert np.mean(got == want) > 0.999
    inside = w / d <= 7.5  # clipped at 7: the other sign's extreme, up to one level off
    assert np.all(np.abs(got - w)[inside] <= (np.abs(d) * 0.5 + 1e-6)[inside]) and inside.mean() > 0.99
    assert np.all(np.abs(got - w) <= np.abs(d) + 1e-6) and not got[:group, 7].any()
    x = rng.standard_normal((3, K)).astype(np.float32)
    layer = to_panels({"w": q})["w"] if native.available() else q
    if getattr(layer, "int8_activations", False):  # the int4 x int8 kernel: x quantized as q8_0 (test_native_int4.py)
        from tests.test_native_int4 import q8_0_oracle

        want = q8_0_oracle(x, np.asarray(q.unpacked()).astype(np.int64), np.asarray(q.scale))
        np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:
        np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), x.astype(np.float64) @ got, rtol=1e-5,
                                   atol=1e-5 * np.sqrt(K))
    with pytest.raises(ValueError, match="int4-g128.*got 'int3'"):
        quantize_layers({"layers": []}, "int3")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int4", "int4-g128"])
def test_int4_on_load_keeps_held_out_perplexity_within_five_percent(method):
    """The issue's bound for 4 bits on the trained default model (measured on 64 windows of 256
    tokens: 1.0038x for groups of 32, 1.0036x for 128; on these 4 windows of 128, see the assert)."""
    from tests.test_quantized import held_out_perplexity_ratio

    ratio = held_out_perplexity_ratio(quantization=method)
    assert ratio != 1 and abs(ratio - 1) < 0.05, ratio
