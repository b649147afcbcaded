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
    step = jax.jit(make_step(config, get_backend("pallas")), static_argnums=(3,), donate_argnums=(1,))
    with cuda_target():  # JAX >= 0.11 lowers Triton kernels only for a GPU it knows (an abstract one here)
        return step.trace(abstract(params), kv_caches, Batch.abstract(SHAPES[kind]), kind == "prefill").lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
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
