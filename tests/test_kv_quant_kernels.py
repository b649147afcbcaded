"""The attention kernels over an 8-bit KV cache (``kv_cache_dtype="int8" | "fp8"``, kv_quant's
layout ``[blocks, block_size, kv_heads, head_dim + 2]``): the Pallas decode and prefill kernels
(interpret mode) and the native C++ decode kernel.

Oracles: the same kernel over the dequantized float copy of the cache (tight: only the order of
the scale's multiplication differs), and a float64 numpy loop over the cache's bytes decoded in
numpy (ml_dtypes for fp8, the last two bytes viewed as float16). Unused slots hold garbage values
and Inf/NaN scales, which must not leak. Plus CUDA lowering of both Pallas kernels with an 8-bit
cache, and the engine's greedy tokens with ``"pallas-interpret"`` against the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paged_jax import native
from paged_jax.attention import AttentionSpec, kv_quant, select_backend
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from tests.attention_oracle import numpy_attention
from tests.test_pallas_kernels import lower_for_cuda, make_case, sds

F16_NAN, F16_INF = np.uint16(0x7E00), np.uint16(0x7C00)


def quantized_case(kind, seed, *, lens, H, KVH, D, block_size, max_blocks, num_blocks, Q=None):
    """q and an 8-bit pool (numpy) with each sequence's tokens in random blocks, garbage values
    elsewhere, and a NaN (K) or Inf (V) scale in every slot no sequence uses (the null block too); or
    a bfloat16 pool (kind "bfloat16": its bits in uint16) with NaN (K) and Inf (V) values there."""
    q, k, v, tables, lens = make_case(seed, lens=lens, H=H, KVH=KVH, D=D, block_size=block_size,
                                      max_blocks=max_blocks, num_blocks=num_blocks, stale_tables=True, Q=Q)
    storage = kv_quant.storage_dtype(kind, "float32")
    kq, vq = (np.array(kv_quant.quantize(jnp.asarray(x), storage)) for x in (k, v))
    used = np.zeros((num_blocks, block_size), bool)
    for s, n in enumerate(lens):
        for t in range(n):
            used[tables[s, t // block_size], t % block_size] = True
    for cache, bad, bf16_bad in ((kq, F16_NAN, 0x7FC0), (vq, F16_INF, 0x7F80)):
        if kind == "bfloat16":
            cache[~used] = bf16_bad
        else:
            cache[..., D:].view(np.uint16)[~used] = bad
    return q, kq, vq, tables, lens


def numpy_dequantize(cache, d):
    """kv_quant's layout decoded in numpy: values (int8, or fp8 e4m3 bits) times the float16 scale;
    a bfloat16 cache's bits (uint16) as their values."""
    if cache.dtype == np.uint16:
        return np.asarray(cache).view(ml_dtypes.bfloat16).astype(np.float64)
    values = cache[..., :d].view(ml_dtypes.float8_e4m3fn) if cache.dtype == np.uint8 else cache[..., :d]
    scale = np.ascontiguousarray(cache[..., d:]).view(np.float16)[..., 0]
    with np.errstate(invalid="ignore"):  # an unused slot's Inf scale times a 0 value
        return values.astype(np.float64) * scale.astype(np.float64)[..., None]


KINDS = ["int8", "fp8"]
VARIANTS = {"plain": {}, "window_softcap": dict(sliding_window=12, logit_soft_cap=30.0)}


@functools.lru_cache(maxsize=None)
def jitted(kernel, **kw):
    return jax.jit(functools.partial(kernel, **kw))


# ---- the Pallas decode kernel (interpret mode) ------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", [*KINDS, "bfloat16"])
def test_pallas_decode_reads_an_8bit_cache(kind, variant):
    """GQA (2 query heads per KV head), ragged lengths (1, mid-block, a block boundary, the maximum, a
    padded row), random tables with stale entries; the window case also splits into 16-token partitions."""
    var = VARIANTS[variant]
    D, scale = 16, 0.25
    q, kq, vq, tables, lens = quantized_case(kind, 3, lens=[1, 21, 32, 0, 48], H=4, KVH=2, D=D, block_size=8,
                                             max_blocks=6, num_blocks=24)
    f = jitted(paged_decode_attention, partition_size=16 if var else None, **var)
    got = np.asarray(f(q, kq, vq, tables, lens, scale))
    kf, vf = kv_quant.dequantize(jnp.asarray(kq), D), kv_quant.dequantize(jnp.asarray(vq), D)
    same = np.asarray(f(q, kf, vf, tables, lens, scale))
    want = numpy_attention(q[:, None], numpy_dequantize(kq, D), numpy_dequantize(vq, D), tables, lens,
                           np.ones_like(lens), scale, window=var.get("sliding_window"),
                           cap=var.get("logit_soft_cap"))[:, 0]
    real = lens > 0
    assert np.isfinite(got).all() and not got[~real].any()
    np.testing.assert_allclose(got[real], same[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_pallas_decode_with_bfloat16_queries_over_an_int8_cache():
    D = 16
    q, kq, vq, tables, lens = quantized_case("int8", 4, lens=[9, 40, 3], H=4, KVH=1, D=D, block_size=8,
                                             max_blocks=5, num_blocks=16)
    got = jitted(paged_decode_attention)(jnp.asarray(q, jnp.bfloat16), kq, vq, tables, lens, 0.25)
    assert got.dtype == jnp.bfloat16
    want = numpy_attention(np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))[:, None],
                           numpy_dequantize(kq, D), numpy_dequantize(vq, D), tables, lens, np.ones_like(lens), 0.25)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want[:, 0], rtol=2e-2, atol=2e-2)


# ---- the Pallas prefill kernel (interpret mode) -----------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", [*KINDS, "bfloat16"])
def test_pallas_prefill_reads_an_8bit_cache(kind, variant):
    """Three query heads per KV head (padded to 4), queries after a cached prefix, a whole prompt, a
    one-query row (a decode) and a padded row."""
    var = VARIANTS[variant]
    D, scale = 16, 0.25
    qlens = np.asarray([8, 5, 1, 0], np.int32)
    q, kq, vq, tables, lens = quantized_case(kind, 5, lens=[30, 5, 17, 0], H=6, KVH=2, D=D, block_size=8,
                                             max_blocks=4, num_blocks=16, Q=8)
    f = jitted(paged_prefill_attention, **var)
    got = np.asarray(f(q, kq, vq, tables, lens, qlens, scale))
    kf, vf = kv_quant.dequantize(jnp.asarray(kq), D), kv_quant.dequantize(jnp.asarray(vq), D)
    same = np.asarray(f(q, kf, vf, tables, lens, qlens, scale))
    want = numpy_attention(q, numpy_dequantize(kq, D), numpy_dequantize(vq, D), tables, lens, qlens, scale,
                           window=var.get("sliding_window"), cap=var.get("logit_soft_cap"))
    assert np.isfinite(got).all()
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got[s, :n], same[s, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[s, :n], want[s, :n], rtol=1e-5, atol=1e-5)


# ---- lowering for CUDA (Triton backend) -------------------------------------------------------------


@pytest.mark.parametrize("kind, dtype", [("int8", "bfloat16"), ("fp8", "float16"), ("fp8", "bfloat16")])
def test_pallas_kernels_lower_for_cuda_with_an_8bit_cache(kind, dtype):
    S, H, KVH, D, nb, bs, mb = 4, 16, 4, 128, 64, 16, 16
    cache = sds((nb, bs, KVH, D + kv_quant.SCALE_BYTES), kv_quant.storage_dtype(kind, dtype))
    tables, lens = sds((S, mb), jnp.int32), sds((S,), jnp.int32)
    decode = functools.partial(paged_decode_attention, partition_size=64, interpret=False)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(decode, sds((S, H, D), dtype), cache, cache, tables, lens, 0.125)
    prefill = functools.partial(paged_prefill_attention, interpret=False, sliding_window=40)
    text = lower_for_cuda(prefill, sds((S, 32, H, D), dtype), cache, cache, tables, lens, lens, 0.125)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kind", KINDS)
def test_engine_step_lowers_for_cuda_with_pallas_over_an_8bit_cache(tiny_llama_dir, kind):
    """The runner's whole step (the quantizing cache write, then the kernels) in bfloat16, decode and prefill."""
    import dataclasses

    from paged_jax.models.loader import load_model
    from tests.test_step_lowering import BLOCK_SIZE, SHAPES, lower_step

    config, params = load_model(tiny_llama_dir, dtype="bfloat16")
    config = dataclasses.replace(config, kv_cache_dtype=kind)
    cache = sds((24, BLOCK_SIZE, config.num_kv_heads, config.head_dim + kv_quant.SCALE_BYTES),
                kv_quant.storage_dtype(kind, "bfloat16"))
    for shape in SHAPES:
        text = lower_step(config, params, [(cache, cache)] * config.num_layers, shape)
        assert "__gpu$xla.gpu.triton" in text and "paged_jax_paged_attention" not in text, shape


def test_pallas_kernels_lower_for_cuda_over_a_bfloat16_cache_in_its_bits():
    """kv_cache_dtype="bfloat16" beside float32 weights: uint16 caches, widened in the kernels."""
    S, H, KVH, D, nb, bs, mb = 4, 16, 4, 128, 64, 16, 16
    cache = sds((nb, bs, KVH, D), kv_quant.storage_dtype("bfloat16", "float32"))
    assert cache.dtype == jnp.uint16
    tables, lens = sds((S, mb), jnp.int32), sds((S,), jnp.int32)
    decode = functools.partial(paged_decode_attention, partition_size=64, interpret=False)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(decode, sds((S, H, D), "float32"), cache, cache, tables, lens, 0.125)
    prefill = functools.partial(paged_prefill_attention, interpret=False)
    text = lower_for_cuda(prefill, sds((S, 32, H, D), "float32"), cache, cache, tables, lens, lens, 0.125)
    assert "__gpu$xla.gpu.triton" in text


def test_pallas_kernels_refuse_an_8bit_cache_without_room_for_the_scale():
    q = jnp.zeros((2, 4, 16), jnp.float32)
    cache = jnp.zeros((4, 8, 2, 16), jnp.int8)  # head_dim bytes only
    with pytest.raises(ValueError, match=r"head_dim \+ 2=18"):
        paged_decode_attention(q, cache, cache, jnp.zeros((2, 2), jnp.int32), jnp.ones(2, jnp.int32), 0.25)


# ---- the native C++ decode kernel -------------------------------------------------------------------

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel not built: {native.status()}")


@needs_native
@pytest.mark.parametrize("kind", [*KINDS, "bfloat16"])
def test_native_decode_reads_an_8bit_cache(kind):
    D, scale = 64, 0.125  # 64: the kernel's unrolled head size
    q, kq, vq, tables, lens = quantized_case(kind, 6, lens=[1, 37, 16, 0, 64, 50], H=8, KVH=2, D=D, block_size=16,
                                             max_blocks=4, num_blocks=24)
    got = np.asarray(native.paged_decode(jnp.asarray(q), kq, vq, tables, lens, scale))
    kf, vf = kv_quant.dequantize(jnp.asarray(kq), D), kv_quant.dequantize(jnp.asarray(vq), D)
    same = np.asarray(native.paged_decode(jnp.asarray(q), kf, vf, tables, lens, scale))
    want = numpy_attention(q[:, None], numpy_dequantize(kq, D), numpy_dequantize(vq, D), tables, lens,
                           np.ones_like(lens), scale)[:, 0]
    real = lens > 0
    assert np.isfinite(got).all() and not got[~real].any()
    np.testing.assert_allclose(got[real], same[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)


@needs_native
def test_native_decode_decodes_every_fp8_code():
    """Sixteen one-token sequences whose values hold all 256 e4m3 codes (NaN's two replaced by 0), scale 1:
    a one-token context's output is its value row, so each code must read back exactly (subnormals,
    both zeros, +-448)."""
    D = 16
    codes = np.arange(256, dtype=np.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    entries = np.zeros((16, D + 2), np.uint8)
    entries[:, :D] = codes.reshape(16, D)
    entries[:, D:] = np.full((16, 1), np.float16(1)).view(np.uint8)
    cache = np.concatenate([np.zeros((1, D + 2), np.uint8), entries])[:, None, None]  # [17 blocks, 1, 1, D + 2]
    tables, lens = np.arange(1, 17, dtype=np.int32)[:, None], np.ones(16, np.int32)
    q = np.ones((16, 2, D), np.float32)  # two query heads share the one KV head
    got = np.asarray(native.paged_decode(jnp.asarray(q), cache, cache, tables, lens, 1.0))
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(16, 1, D)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


# ---- the backends and the engine --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["pallas-interpret", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_backends_take_8bit_caches(backend, kind):
    spec = AttentionSpec(0.1, sliding_window=8, logit_soft_cap=30.0) if backend != "native" else AttentionSpec(0.1)
    if backend == "native" and not native.available():
        pytest.skip("native kernel not built")
    assert select_backend(backend, [spec], kind).name == backend


@pytest.mark.parametrize("backend, kind", [("pallas-interpret", "int8"), ("native", "fp8"), ("native", "bfloat16"),
                                           ("pallas-interpret", "bfloat16"),
                                           pytest.param("pallas-interpret", "fp8", marks=pytest.mark.slow)])
def test_engine_over_an_8bit_cache_matches_reference_greedy(tiny_llama_dir, backend, kind):
    """The kernels over the 8-bit cache (chunked prefill: prefill chunks beside decodes; both Pallas
    kernels, or the native decode) give the reference backend's tokens over the same cache dtype."""
    from paged_jax import LLM, SamplingParams

    if backend == "native" and not native.available():
        pytest.skip("native kernel not built")
    prompts = [[5, 9, 200, 31, 7, 77, 8, 19, 4, 11, 300, 12, 6], [42], [3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=5)
    got = {}
    for name in ("reference", backend):
        llm = LLM(model=str(tiny_llama_dir), attention_backend=name, kv_cache_dtype=kind, block_size=4,
                  num_kv_blocks=24, enable_chunked_prefill=True, max_num_batched_tokens=8)
        assert llm.llm_engine.runner.kv_caches[0][0].dtype == kv_quant.storage_dtype(kind, "float32")
        assert llm.llm_engine.runner.attention_backend == name
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got[name] = [o.outputs[0].token_ids for o in outs]
    assert got[backend] == got["reference"]
    assert all(len(t) == 5 for t in got["reference"])
