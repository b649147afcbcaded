"""The engine's whole jitted step lowers for CUDA with the "pallas" backend, for every model family
(iterating the registry, so a family added later is covered) in float16 and bfloat16.

The step is the runner's own (``make_step``) with the backend object taken from the registry
unchecked: "pallas" refuses to *run* without a GPU, but lowering needs none. Lowering does not
prove the kernels compile on a GPU (Triton IR becomes GPU code inside XLA's GPU compiler)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from paged_jax.attention import get_backend, select_backend
from paged_jax.executor.batch import Batch
from paged_jax.executor.model_runner import make_step
from paged_jax.models import FAMILIES
from pallas_kernels.cuda_lowering import cuda_target
from tests.slow_cases import slow_unless

BLOCK_SIZE = 16
SHAPES = {"decode": (8, 8, 4, 0), "prefill": (32, 32, 4, 4)}  # Batch.shape_key: (T, S, B, query tiles)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from paged_jax.models.tiny import make_tiny_model

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family, seed=0)
        return cache[family]

    return get


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def lower_step(config, params, kv_caches, kind: str) -> str:
    """The runner's step for ``config`` with the "pallas" backend, lowered for CUDA at a ``kind`` shape."""
    return lower_shape(config, params, kv_caches, SHAPES[kind], kind == "prefill").as_text()


def lower_shape(config, params, kv_caches, shape_key, all_logits: bool):
    """The runner's step with the "pallas" backend, lowered for CUDA at ``shape_key`` (a Lowered)."""
    step = jax.jit(make_step(config, get_backend("pallas")), static_argnums=(3,), donate_argnums=(1,))
    with cuda_target():  # JAX >= 0.11 lowers Triton kernels only for a GPU it knows (an abstract one here)
        return step.trace(abstract(params), kv_caches, Batch.abstract(shape_key), all_logits).lower(
            lowering_platforms=("cuda",))


# float16 lowers the same kernels as bfloat16 (its 13 cases: -m slow)
@pytest.mark.parametrize("dtype", slow_unless(["float16", "bfloat16"], {"bfloat16"}))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_lowers_for_cuda_with_the_pallas_backend(family, dtype, tiny_dirs):
    from paged_jax.models.loader import load_model

    config, params = load_model(tiny_dirs(family), dtype=dtype)
    if config.attention_sinks:  # gpt-oss: the Pallas kernels have no sinks, and the engine refuses them at start
        with pytest.raises(ValueError, match="'pallas' does not honour the model's attention sinks=True"):
            select_backend("pallas", [config.attention_spec(i) for i in range(config.num_layers)], dtype)
        return
    cache = jax.ShapeDtypeStruct((24, BLOCK_SIZE, config.num_kv_heads, config.head_dim), jnp.dtype(dtype))
    kv_caches = [(cache, cache)] * config.num_layers
    # The family as it is, and with a sliding window and a logit soft-cap in its config.
    variant = dataclasses.replace(config, sliding_window=8, attn_logit_softcap=30.0)
    for cfg, kind in itertools.product((config, variant), SHAPES):
        text = lower_step(cfg, params, kv_caches, kind)
        kernels = ["paged_decode_attention"] + (["paged_prefill_attention"] if kind == "prefill" else [])
        # Every layer calls the step's kernels (a step with prefill tokens: the decode kernel on each
        # sequence's last token, the prefill kernel on the query tiles), Triton calls; no CPU kernel.
        # (Layers with the same spec share one lowered function; layers whose specs differ, e.g.
        # Gemma 2's windowed and full ones, get one each.)
        for kernel in kernels:
            assert len(re.findall(rf"call @{kernel}(_\d+)?\(", text)) == config.num_layers, (family, kind, kernel)
        assert "__gpu$xla.gpu.triton" in text and "paged_jax_paged_attention" not in text, (family, kind)


def test_speculative_verification_step_lowers_for_cuda_as_query_tiles(tiny_dirs):
    """Speculative decoding's verification step on "pallas": the backend declares ``verifies_in_tiles``,
    so a row's pending token and its drafts are one query tile of the prefill kernel (the runner's
    chunks, ``verification_chunks``), and the step returns every token's logits; lowered for CUDA."""
    from paged_jax.executor.batch import prepare_batch
    from paged_jax.executor.draft_rows import drafts_as_rows, verification_chunks
    from paged_jax.executor.interface import RowSampling
    from paged_jax.models.loader import load_model
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.scheduler import ScheduledSeq, SchedulerOutput
    from paged_jax.sequence import Sequence

    config, params = load_model(tiny_dirs("llama"), dtype="bfloat16")
    # Two decoding rows, with 4 drafts and with none: each has computed all but its pending token (and drafts).
    rows, sampling = [], []
    for seq_id, (prompt, output, drafts) in enumerate([(list(range(3, 23)), [7, 8, 9, 10, 11], 4), ([5] * 9, [6], 0)]):
        seq = Sequence(seq_id, prompt, output, num_computed_tokens=len(prompt) + len(output) - drafts - 1)
        rows.append(ScheduledSeq(seq, None, drafts + 1, list(range(1 + 2 * seq_id, 3 + 2 * seq_id))))
        sampling.append(RowSampling(SamplingParams(temperature=0), (None,), num_speculative_tokens=drafts))
    as_rows = drafts_as_rows(get_backend("pallas"))
    chunks, owners = verification_chunks(SchedulerOutput(scheduled=rows), sampling, as_rows)
    assert [len(c.token_ids) for c in chunks] == [5, 1] and owners == [(0, 0), (1, None)]
    shape = prepare_batch(chunks, BLOCK_SIZE).shape_key
    assert shape[3] > 0  # query tiles
    cache = jax.ShapeDtypeStruct((24, BLOCK_SIZE, config.num_kv_heads, config.head_dim), jnp.bfloat16)
    lowered = lower_shape(config, params, [(cache, cache)] * config.num_layers, shape, not as_rows)
    text = lowered.as_text()
    for kernel in ("paged_decode_attention", "paged_prefill_attention"):
        assert len(re.findall(rf"call @{kernel}(_\d+)?\(", text)) == config.num_layers, kernel
    assert "__gpu$xla.gpu.triton" in text and "paged_jax_paged_attention" not in text
    logits = lowered.out_info[0].logits
    assert logits.shape == (shape[0], config.vocab_size)  # every token's: the row's k + 1 positions are scored
