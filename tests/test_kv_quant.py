"""The 8-bit KV cache (``kv_cache_dtype="int8" | "fp8"``, paged_jax/attention/kv_quant.py).

Oracles: numpy for the quantizer; the attention backends on a float cache holding the same
dequantized values (what the 8-bit cache must read back through the block table); the engine
without preemption or prefix caching for swap, recompute and shared blocks; the float cache's
perplexity for quality; the pool's arithmetic for capacity.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams, native
from paged_jax.attention import NATIVE, REFERENCE, AttentionMetadata, AttentionSpec, kv_quant, write_kv
from paged_jax.attention.reference import paged_attention_reference
from tests.test_quantized import held_out_perplexity_ratio


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_each_token_and_head_gets_its_own_float16_scale(kind):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3, 16)) * rng.uniform(0.01, 20, size=(5, 3, 1))).astype(np.float32)
    x[2, 1] = 0  # an all-zero head
    storage = kv_quant.storage_dtype(kind, "float32")
    q = np.asarray(kv_quant.quantize(jnp.asarray(x), storage))
    assert q.shape == (5, 3, 18) and q.dtype == storage
    top = 127.0 if kind == "int8" else 448.0
    scale = np.abs(x).max(-1, keepdims=True) / top
    scale = np.where(scale == 0, 1, scale).astype(np.float16)
    np.testing.assert_array_equal(q[..., 16:].copy().view(np.float16), scale)
    s32 = scale.astype(np.float32)
    if kind == "int8":
        want = np.clip(np.round(x / s32), -127, 127)
        np.testing.assert_array_equal(q[..., :16], want)
    else:
        want = np.clip(x / s32, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(q[..., :16].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float32), want)
    back = np.asarray(kv_quant.dequantize(jnp.asarray(q), 16))
    np.testing.assert_allclose(back, want * s32, rtol=1e-6)
    assert not back[2, 1].any()
    if kind == "int8":  # within half a step of the original
        assert (np.abs(back - x) <= s32 * 0.5 * (1 + 1e-3) + 1e-7).all()


def _meta(tables, context_lens, query_lens, slot_mapping):
    return AttentionMetadata(block_tables=jnp.asarray(tables, jnp.int32),
                             context_lens=jnp.asarray(context_lens, jnp.int32),
                             query_lens=jnp.asarray(query_lens, jnp.int32),
                             slot_mapping=jnp.asarray(slot_mapping, jnp.int32), token_seq=None, token_qidx=None)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_backends_read_an_8bit_cache_through_the_block_table_as_its_dequantized_float_copy(kind):
    """Write K/V for two sequences at scattered blocks, then decode and prefill over the 8-bit cache:
    the same outputs as over a float cache holding the dequantized values."""
    rng = np.random.default_rng(1)
    nb, bs, kvh, d, h = 12, 4, 2, 16, 4
    storage = kv_quant.storage_dtype(kind, "float32")
    kq = jnp.zeros((nb, bs, kvh, d + 2), storage)
    vq = jnp.zeros((nb, bs, kvh, d + 2), storage)
    tables = [[7, 2, 9], [4, 11, 0]]
    lens = [10, 6]
    slots = [tables[s][i // bs] * bs + i % bs for s in range(2) for i in range(lens[s])]
    k = jnp.asarray(rng.standard_normal((len(slots), kvh, d)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((len(slots), kvh, d)).astype(np.float32))
    kq, vq = write_kv(kq, vq, k, v, jnp.asarray(slots, jnp.int32))
    kf, vf = kv_quant.dequantize(kq, d), kv_quant.dequantize(vq, d)
    assert float(jnp.abs(kf.reshape(-1, kvh, d)[jnp.asarray(slots)] - k).max()) < 0.1  # written where they belong
    spec = AttentionSpec(scale=d ** -0.5)
    q = jnp.asarray(rng.standard_normal((2, h, d)).astype(np.float32))
    meta = _meta(tables, lens, [1, 1], [0, 0])
    want = np.asarray(REFERENCE.decode(q, kf, vf, meta, spec))
    np.testing.assert_allclose(np.asarray(REFERENCE.decode(q, kq, vq, meta, spec)), want, rtol=1e-5, atol=1e-5)
    if kind == "int8" and native.available():  # the C++ decode kernel reads the int8 entries and scales itself
        np.testing.assert_allclose(np.asarray(NATIVE.decode(q, kq, vq, meta, spec)), want, rtol=1e-5, atol=1e-5)
    qp = jnp.asarray(rng.standard_normal((2, 5, h, d)).astype(np.float32))
    meta = _meta(tables, lens, [5, 3], [0])
    want = paged_attention_reference(qp, kf, vf, meta.block_tables, meta.context_lens, meta.query_lens, spec.scale)
    for got in (REFERENCE.prefill(qp, kq, vq, meta, spec),
                paged_attention_reference(qp, kq, vq, meta.block_tables, meta.context_lens, meta.query_lens,
                                          spec.scale)):
        np.testing.assert_allclose(np.asarray(got)[0], np.asarray(want)[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got)[1, :3], np.asarray(want)[1, :3], rtol=1e-5, atol=1e-5)


PROMPTS = ["def __init__(self, ", "import os\nimport sys\n", "    def close(self):\n", "class Config:\n"]


def _tokens(**kw):
    llm = LLM(max_model_len=256, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def test_the_same_memory_holds_more_blocks_and_int8_keeps_the_default_models_greedy_tokens():
    memory = dict(cpu_kv_cache_space=0.04)  # GiB, the same for both
    llm_f, want = _tokens(**memory)
    llm_q, got = _tokens(kv_cache_dtype="int8", **memory)
    blocks = {name: llm.llm_engine.scheduler.block_manager.get_usage().num_total_gpu_blocks for name, llm in
              (("float32", llm_f), ("int8", llm_q))}
    d = llm_q.llm_engine.runner.config.head_dim
    ratio = (blocks["int8"] + 1) / (blocks["float32"] + 1)  # the null block too: the memory holds all of them
    assert ratio == pytest.approx(4 * d / (d + 2), rel=0.005), (blocks, d)  # 4 bytes per value vs 1, and the scale
    k = llm_q.llm_engine.runner.kv_caches[0][0]
    assert k.dtype == jnp.int8 and k.shape[-1] == d + 2
    # the native decode kernel reads int8 caches itself; without it, the reference
    assert llm_q.llm_engine.runner.attention_backend == ("native" if native.available() else "reference")
    assert got == want


def test_an_8bit_cache_survives_swap_recompute_and_prefix_sharing():
    _, want = _tokens(kv_cache_dtype="int8")
    for mode in ("swap", "recompute"):
        llm, got = _tokens(kv_cache_dtype="int8", block_size=4, num_kv_blocks=30, preemption_mode=mode)
        assert llm.llm_engine.scheduler.num_preemptions[mode] > 0
        assert got == want
    llm = LLM(max_model_len=256, kv_cache_dtype="int8", enable_prefix_caching=True, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    again = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]  # cached prefixes
    assert first == want and again == want


@pytest.mark.parametrize("kind", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_8bit_cache_keeps_held_out_perplexity_within_one_percent(kind):
    ratio = held_out_perplexity_ratio(kv_cache_dtype=kind)
    assert ratio != 1 and abs(ratio - 1) < 0.01, ratio


def test_kv_cache_dtype_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8', 'fp8'\], got 'int4'"):
        LLM(kv_cache_dtype="int4")
