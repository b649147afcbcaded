"""Warm-up compiles every step shape a run reaches: afterwards serving compiles nothing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from paged_jax.executor.batch import SeqChunk, prepare_batch, split_steps, warmup_shapes

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, block_size=8)


def _random_step(rng, max_num_seqs, max_num_batched_tokens, max_model_len, block_size, reserved=False):
    """A step the scheduler could emit: decode rows, then prompts or chunks of prompts within the token budget.
    ``reserved``: every table holds ``max_model_len`` tokens' blocks (the ``Orca("max")`` policy)."""
    chunks, budget = [], max_num_batched_tokens

    def table(tokens):
        return list(range(1, -(-(max_model_len if reserved else tokens) // block_size) + 1))

    for _ in range(int(rng.integers(0, max_num_seqs + 1))):
        ctx = int(rng.integers(2, max_model_len + 1))
        chunks.append(SeqChunk([1], ctx - 1, table(ctx)))
        budget -= 1
    if chunks and rng.random() < 0.3:  # a decode step
        return chunks
    top = np.log(min(max_num_batched_tokens, max_model_len) + 1)
    lo, hi = sorted(rng.uniform(0, top, 2))  # prompt lengths of this step: log-uniform in a random range
    while len(chunks) < max_num_seqs and budget > 0 and rng.random() < 0.95:
        q = min(budget, max_model_len, max(1, int(np.exp(rng.uniform(lo, hi)))))
        # A whole prompt, or a chunk after a cached prefix (chunked prefill, prefix caching).
        start = 0 if rng.random() < 0.5 else int(rng.integers(0, max_model_len - q + 1))
        chunks.append(SeqChunk([1] * q, start, table(start + q)))
        budget -= q
    return chunks


@pytest.mark.parametrize("cfg", [(4, 32, 32, 8), (8, 64, 64, 4), (16, 100, 80, 16), (128, 2048, 512, 16),
                                 (7, 50, 50, 3)])
def test_warmup_shapes_cover_every_batch(cfg):
    shapes = set(warmup_shapes(*cfg))
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(4000):
        chunks = _random_step(rng, *cfg, reserved=i % 2 == 1)
        if not chunks:
            continue
        rows = []
        for part in split_steps(chunks):
            batch = prepare_batch([chunks[i] for i in part], cfg[3])
            assert batch.shape_key in shapes, (batch.shape_key, [len(chunks[i].token_ids) for i in part])
            seen.add(batch.shape_key)
            rows += part
        assert rows == list(range(len(chunks)))
    # The enumeration is not much wider than what random steps reach.
    assert len(seen) >= 0.5 * len(shapes)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from paged_jax.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), family="gpt2", seed=1)


def test_no_compilation_after_warm_up(gpt2_dir):
    import jax.monitoring

    from paged_jax import LLM, SamplingParams

    events = Counter()

    def listen(name, *_, **__):
        if name.startswith("/jax/core/compile/"):
            events[name] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        warm = LLM(str(gpt2_dir), num_kv_blocks=24, warm_up=True, **CONFIG)
        assert events["/jax/core/compile/jaxpr_trace_duration"] > 0
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 300, size=int(rng.integers(1, 30))).tolist() for _ in range(20)]
        params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
                  for _ in prompts]
        before = warm.llm_engine.get_stats()["num_compilations"]
        events.clear()
        outs = warm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert dict(events) == {}, f"compiled after warm-up: {dict(events)}"
        stats = warm.llm_engine.get_stats()
        assert stats["num_compilations"] == before
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        for k in ("schedule", "process", "detokenize", "prepare", "device", "sample"):
            assert stats["timings"][k] > 0, k
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    # The ahead-of-time compiled steps give what the engine computes without warm-up.
    cold = LLM(str(gpt2_dir), num_kv_blocks=24, **CONFIG)
    ref = cold.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(len(o.outputs[0].token_ids) == min(p.max_tokens, CONFIG["max_model_len"] - len(t))
               for o, p, t in zip(outs, params, prompts))


def test_abstract_batch_is_the_real_batch_without_values():
    """Warm-up compiles against ``Batch.abstract(shape_key)``: the same pytree (treedef, static
    tile_size) with each leaf's shape and dtype, for every batch prepare_batch makes."""
    import jax

    from paged_jax.executor.batch import Batch

    rng = np.random.default_rng(1)
    for _ in range(50):
        chunks = _random_step(rng, **CONFIG)
        for part in split_steps(chunks):
            batch = prepare_batch([chunks[i] for i in part], CONFIG["block_size"])
            abstract = Batch.abstract(batch.shape_key)
            assert jax.tree.structure(abstract) == jax.tree.structure(batch)
            assert [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)] == \
                [(x.shape, x.dtype) for x in jax.tree.leaves(batch)]
            assert batch.num_seqs == len(part) and batch.num_tokens == sum(len(chunks[i].token_ids) for i in part)
