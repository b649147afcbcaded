"""The Pallas kernels compiled for a CUDA GPU (Triton), and the engine on them, against oracles.

Marked ``gpu`` and skipped where ``jax.default_backend() != "gpu"``. On a GPU machine:

    python -m pytest -m gpu tests/test_gpu.py

(about 40 kernel compilations and five engines on the bundled default model: sized to take well
under three minutes on an H100). Where there is no GPU, ``PAGED_JAX_GPU_TESTS=interpret`` runs the
same tests with the kernels in Pallas interpret mode and the engine on ``"pallas-interpret"``
(about 3 minutes on 2 CPU cores), to check the tests themselves; on a GPU it changes nothing.

Kernel cases: decode and prefill; float32, bfloat16 and float16 caches, and int8 / fp8 caches
(kv_quant's layout; fp8 needs compute capability >= 8.9 for Triton's fp8 conversion, skipped with
the reason below that); one query head per KV head (MHA) and four (GQA); no variant, and a sliding
window with a logit soft-cap; decode also split into partitions (flash-decoding). Ragged lengths
(1, mid-block, on a block boundary, 512, a padded row), permuted block tables with stale entries,
garbage (and for 8-bit caches NaN / Inf scales) in every unused slot.

Oracles: ``paged_attention_reference`` (plain jnp) in float32 on the kernel's own (rounded)
inputs, at ``highest`` matmul precision (a GPU's default float32 matmul is TF32, ~1e-3 relative:
the oracle must not carry that error); an 8-bit cache is decoded for it in numpy (ml_dtypes
for fp8, the scale's two bytes viewed as float16), not by the project's dequantizer.

Tolerances (absolute and relative) per query dtype:
- float32: 2e-5. The kernels multiply in IEEE float32 (``Precision.HIGHEST``, checked in the
  Triton IR by ``test_pallas_kernels.py``); sums over <= 512 keys and libdevice exp / tanh
  (<= 2 ulp) stay near 1e-6, while TF32 products would miss by ~1e-3: the bound tells them apart.
- bfloat16 / float16: 2e-2. Inputs are rounded alike on both sides; the kernel also rounds the
  softmax weights to the cache dtype for the second product (as flash attention does, 2^-8
  relative for bfloat16) and its output (another 2^-8), on outputs of magnitude <= ~1.

Engine: the bundled default model (a trained LLaMA: GQA with 8 query heads on 4 KV heads, head
size 32), greedy, with ``attention_backend="pallas"`` against ``"reference"``, every run at
``highest`` matmul precision. float32: every token equal (the two differ by float32 rounding
only). bfloat16: every request's first token equal to the reference's in bfloat16 (later tokens
may part at a near-tie: 16-bit rounding, not a kernel error). With n-gram speculative decoding
(float32), a row's pending token and drafts are one query tile of the prefill kernel: every token
equal to the reference's plain decoding, with drafts accepted.
"""

from __future__ import annotations

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import soft_cap_mod, window_mask_mod
from paged_jax.attention.reference import paged_attention_reference
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from tests.test_kv_quant_kernels import numpy_dequantize, quantized_case
from tests.test_pallas_kernels import make_case

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU and os.environ.get("PAGED_JAX_GPU_TESTS") == "interpret"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_GPU or INTERPRET), reason=f"needs a CUDA GPU (jax.default_backend() is "
                                                         f"{jax.default_backend()!r}); PAGED_JAX_GPU_TESTS=interpret "
                                                         "runs these tests in interpret mode"),
]

TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-2}  # by query dtype; see the module docstring

# One layer's shapes: head size 128, block size 16, 4 KV heads; MHA and GQA (4 query heads per KV head).
D, BLOCK, KVH = 128, 16, 4
HEADS = {"mha": 4, "gqa": 16}
LENS = [1, 100, 128, 257, 512, 0]  # one token, mid-block, on a block boundary, mid-block, the maximum, padding
QLENS = [1, 100, 128, 57, 128, 0]  # prefill: a decode row, whole prompts, chunks after a cached prefix, padding
MAX_BLOCKS, NUM_BLOCKS = 32, 80  # 65 blocks in use; the rest (and stale table entries) hold garbage
VARIANTS = {"plain": {}, "window_softcap": dict(sliding_window=100, logit_soft_cap=2.0)}


def compute_capability() -> float | None:
    """The GPU's compute capability (e.g. 9.0), or None off a GPU."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return float(cc) if ON_GPU and cc else None


def skip_fp8_without_sm89(cache: str) -> None:
    cc = compute_capability()
    if cache == "fp8" and cc is not None and cc < 8.9:
        pytest.skip(f"an fp8 cache needs compute capability >= 8.9 (Triton's fp8 conversion); this GPU has {cc}")


def cases(kinds):
    """(query dtype, cache kind, heads, variant) over ``kinds`` x MHA/GQA x the variants."""
    return [(q, c, h, v) for (q, c), h, v in itertools.product(kinds, HEADS, VARIANTS)]


# Float caches in the model dtype, and 8-bit caches read by bfloat16 queries (what a bfloat16 model with
# kv_cache_dtype="int8" | "fp8" runs); then single cases: float16, an int8 cache under float32 queries, and a
# bfloat16 cache under float32 queries (kv_cache_dtype="bfloat16" beside float32 weights: its bits in uint16).
MAIN = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "int8"), ("bfloat16", "fp8")]
EXTRA = [("float16", "float16", "gqa", "plain"), ("float32", "int8", "gqa", "plain"),
         ("float32", "bfloat16", "gqa", "plain")]
KERNEL_CASES = cases(MAIN) + EXTRA
IDS = ["-".join(c) for c in KERNEL_CASES]


@functools.lru_cache(maxsize=None)
def make_inputs(q_dtype: str, cache: str, heads: str, Q: int | None):
    """(q, k, v, tables, lens) as numpy arrays in the kernel's dtypes, and (q, k, v) in float32 for the
    oracle: the same values (q rounded to its dtype; an 8-bit cache decoded in numpy)."""
    H = HEADS[heads]
    shape = dict(lens=LENS, H=H, KVH=KVH, D=D, block_size=BLOCK, max_blocks=MAX_BLOCKS, num_blocks=NUM_BLOCKS, Q=Q)
    seed = sum(map(ord, q_dtype + cache + heads)) + (Q or 0)
    if cache in ("int8", "fp8") or (cache == "bfloat16" and q_dtype != "bfloat16"):  # kv_quant's layouts
        q, k, v, tables, lens = quantized_case(cache, seed, **shape)
        # Unused slots decode to NaN / Inf (their scales): the kernel sees them raw; the oracle, which
        # never looks at them either, gets zeros there so that its own arithmetic stays finite.
        kf, vf = (np.nan_to_num(numpy_dequantize(x, D), nan=0.0, posinf=0.0, neginf=0.0) for x in (k, v))
    else:
        q, k, v, tables, lens = make_case(seed, dtype=cache, stale_tables=True, **shape)
        kf, vf = k, v
    q = np.asarray(jnp.asarray(q, q_dtype))
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
    return (q, k, v, tables, lens), (f32(q), f32(kf), f32(vf))


def oracle(q, k, v, tables, lens, qlens, scale, variant):
    """The jnp reference in float32 at full matmul precision; q [S, Q, H, D]."""
    var = VARIANTS[variant]
    with jax.default_matmul_precision("highest"):
        out = paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
                                        jnp.asarray(lens), jnp.asarray(qlens), scale,
                                        score_mod=soft_cap_mod(var.get("logit_soft_cap")),
                                        mask_mod=window_mask_mod(var.get("sliding_window")))
    return np.asarray(out)


@functools.lru_cache(maxsize=None)
def decode_fn(variant: str, partition_size):
    return jax.jit(functools.partial(paged_decode_attention, partition_size=partition_size, interpret=INTERPRET,
                                     **VARIANTS[variant]))


@functools.lru_cache(maxsize=None)
def prefill_fn(variant: str):
    return jax.jit(functools.partial(paged_prefill_attention, interpret=INTERPRET, **VARIANTS[variant]))


def assert_close(got, want, q_dtype, what):
    np.testing.assert_allclose(got, want, atol=TOL[q_dtype], rtol=TOL[q_dtype], err_msg=what)


# ---- the decode kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype,cache,heads,variant", KERNEL_CASES, ids=IDS)
def test_decode_kernel_matches_reference(q_dtype, cache, heads, variant):
    skip_fp8_without_sm89(cache)
    (q, k, v, tables, lens), (qf, kf, vf) = make_inputs(q_dtype, cache, heads, None)
    scale = D ** -0.5
    got = decode_fn(variant, None)(q, k, v, tables, lens, scale)
    assert got.dtype == jnp.dtype(q_dtype)
    got = np.asarray(got.astype(jnp.float32))
    real = lens > 0
    assert np.isfinite(got).all() and not got[~real].any(), "padded rows give zeros, no row NaN / Inf"
    want = oracle(qf[:, None], kf, vf, tables, lens, real.astype(np.int32), scale, variant)[:, 0]
    assert_close(got[real], want[real], q_dtype, f"decode {q_dtype} over {cache}, {heads}, {variant}")


@pytest.mark.parametrize("q_dtype,variant", [("float32", "plain"), ("bfloat16", "window_softcap")])
def test_decode_kernel_in_partitions_matches_reference(q_dtype, variant):
    """Flash-decoding: 64-token partitions run in parallel and are merged (with a window, partitions
    wholly before it read nothing)."""
    (q, k, v, tables, lens), (qf, kf, vf) = make_inputs(q_dtype, q_dtype, "gqa", None)
    got = np.asarray(decode_fn(variant, 64)(q, k, v, tables, lens, D ** -0.5).astype(jnp.float32))
    real = lens > 0
    assert np.isfinite(got).all() and not got[~real].any()
    want = oracle(qf[:, None], kf, vf, tables, lens, real.astype(np.int32), D ** -0.5, variant)[:, 0]
    assert_close(got[real], want[real], q_dtype, f"decode in partitions, {q_dtype}, {variant}")


# ---- the prefill kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype,cache,heads,variant", KERNEL_CASES, ids=IDS)
def test_prefill_kernel_matches_reference(q_dtype, cache, heads, variant):
    skip_fp8_without_sm89(cache)
    Q = max(QLENS)
    (q, k, v, tables, lens), (qf, kf, vf) = make_inputs(q_dtype, cache, heads, Q)
    qlens = np.asarray(QLENS, np.int32)
    scale = D ** -0.5
    got = prefill_fn(variant)(q, k, v, tables, lens, qlens, scale)
    assert got.dtype == jnp.dtype(q_dtype)
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all() and not got[lens == 0].any(), "padded sequences give zeros, no row NaN / Inf"
    want = oracle(qf, kf, vf, tables, lens, qlens, scale, variant)
    for s, n in enumerate(QLENS):  # rows past a sequence's query length are padding (unspecified)
        assert_close(got[s, :n], want[s, :n], q_dtype, f"prefill {q_dtype} over {cache}, {heads}, {variant}, seq {s}")


# ---- the engine end to end ---------------------------------------------------------------------------

PROMPTS = ["def __init__(self, ", "class ParseError(Exception):\n    \"\"\"", "for i in range(",
           "def read_file(path):\n    with open("]
MAX_TOKENS = 16


# n-gram drafts at every batch size, from suffixes of 1 to 3 tokens: most steps draft.
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
               "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def greedy_tokens():
    """greedy_tokens(backend, dtype, speculative=False) -> each prompt's generated token ids (each run once
    per module); ``greedy_tokens.spec_stats``: a speculative run's ``get_stats()["spec_decode"]``."""
    from paged_jax import LLM, SamplingParams

    runs = {}

    def get(backend: str, dtype: str, speculative: bool = False):
        if backend == "pallas" and INTERPRET:
            backend = "pallas-interpret"
        if (backend, dtype, speculative) not in runs:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            # Traced (and compiled) inside the context: every matmul of the run at full float32 precision,
            # so that float32 runs differ only by the attention's rounding. A small pool: quick to allocate.
            with jax.default_matmul_precision("highest"):
                llm = LLM(attention_backend=backend, dtype=dtype, max_model_len=256, num_kv_blocks=64,
                          speculative_config=SPECULATIVE if speculative else None)
                outs = llm.generate(PROMPTS, params, use_tqdm=False)
            stats = llm.llm_engine.get_stats()
            chosen = stats.get("attention_backend", backend)
            assert chosen == backend, (backend, chosen)
            if speculative:
                get.spec_stats = stats["spec_decode"]
            runs[backend, dtype, speculative] = [list(o.outputs[0].token_ids) for o in outs]
        return runs[backend, dtype, speculative]

    return get


def test_engine_pallas_float32_greedy_equals_reference(greedy_tokens):
    """Prefill steps (the prefill kernel) and decode steps (the decode kernel) on every layer: the same
    greedy tokens as the reference backend, every token of every request."""
    want = greedy_tokens("reference", "float32")
    got = greedy_tokens("pallas", "float32")
    assert all(len(t) == MAX_TOKENS for t in want)
    assert got == want


def test_engine_pallas_bfloat16_first_tokens_agree(greedy_tokens):
    want = greedy_tokens("reference", "bfloat16")
    got = greedy_tokens("pallas", "bfloat16")
    assert [t[0] for t in got] == [t[0] for t in want]
    assert all(len(t) == MAX_TOKENS for t in got)


def test_engine_pallas_float32_speculative_greedy_equals_reference(greedy_tokens):
    """n-gram speculative decoding on "pallas": each drafted row's pending token and drafts are one query
    tile of the prefill kernel (causal within the tile); every token equal to plain decoding on the reference."""
    want = greedy_tokens("reference", "float32")
    got = greedy_tokens("pallas", "float32", speculative=True)
    assert got == want
    stats = greedy_tokens.spec_stats
    assert stats["num_drafts"] > 0 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
