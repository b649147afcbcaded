"""One ragged, token-flat step: decodes and prefill chunks of random lengths side by side in one
batch, through every backend's ``paged_attention_layer`` path, against the numpy oracle; the batch
layout (query tiles, no padding to the longest prompt); the split of a step only when its query
tiles overflow; and the engine running a mixed step as one model call."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from paged_jax import native
from paged_jax.attention import AttentionSpec, get_backend, paged_attention_layer
from paged_jax.executor.batch import (SeqChunk, num_tiles, prepare_batch, split_steps, tile_capacity,
                                      warmup_shapes)
from tests.attention_oracle import numpy_attention

BS, H, KVH, D = 4, 4, 2, 8


def random_step(rng, num_blocks=64, max_ctx=40, tile_size=8):
    """Decode rows first, then prefill chunks (whole prompts or chunks after a cached prefix),
    random lengths, each sequence's blocks drawn from a shuffled pool."""
    pool = list(rng.permutation(np.arange(1, num_blocks)))
    chunks = []
    kinds = ["decode"] * int(rng.integers(0, 5)) + ["prefill"] * int(rng.integers(1, 4))
    for kind in kinds:
        ctx = int(rng.integers(2, max_ctx))
        n = 1 if kind == "decode" else int(rng.choice([ctx, rng.integers(1, ctx + 1)]))
        table = [int(pool.pop()) for _ in range(-(-ctx // BS))]
        chunks.append(SeqChunk(rng.integers(0, 100, size=n).tolist(), ctx - n, table))
    return chunks


def oracle(chunks, k_cache, v_cache, q_flat, scale, window, cap):
    """numpy_attention per sequence (the cache already holds the step's K/V), back to token-flat."""
    out, t = [], 0
    for c in chunks:
        n = len(c.token_ids)
        end = c.start_pos + n
        table = np.asarray(c.block_table, np.int32)[None]
        o = numpy_attention(q_flat[None, t:t + n], k_cache, v_cache, table, np.array([end]), np.array([n]), scale,
                            window=window, cap=cap)
        out.append(o[0])
        t += n
    return np.concatenate(out)


BACKENDS = ["reference", "native", "pallas-interpret"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_layer_matches_numpy(backend, seed):
    windowed = seed == 2
    spec = AttentionSpec(0.3, sliding_window=7 if windowed else None, logit_soft_cap=4.0 if windowed else None)
    if backend == "native" and not native.available():
        pytest.skip(f"native kernel not built: {native.status()}")
    rng = np.random.default_rng(seed)
    chunks = random_step(rng)
    batch = prepare_batch(chunks, BS, tile_size=8)
    T = batch.input_ids.shape[0]
    q = rng.normal(size=(T, H, D)).astype(np.float32) * 2
    k = rng.normal(size=(T, KVH, D)).astype(np.float32)
    v = rng.normal(size=(T, KVH, D)).astype(np.float32)
    k_cache = rng.normal(size=(64, BS, KVH, D)).astype(np.float32)
    v_cache = rng.normal(size=(64, BS, KVH, D)).astype(np.float32)
    layer = jax.jit(functools.partial(paged_attention_layer, spec=spec, backend=get_backend(backend)))
    out, (kc, vc) = layer(q, k, v, (k_cache, v_cache), meta=batch)
    n = batch.num_tokens
    want = oracle(chunks, np.asarray(kc), np.asarray(vc), q[:n], spec.scale, spec.sliding_window,
                  spec.logit_soft_cap)
    np.testing.assert_allclose(np.asarray(out)[:n], want, atol=3e-5, rtol=0)
    # The cache holds the step's K/V at each token's slot (the oracle read them from there).
    flat_k = np.asarray(kc).reshape(-1, KVH, D)
    np.testing.assert_array_equal(flat_k[batch.slot_mapping[:n]], k[:n])


def test_batch_is_token_flat_with_query_tiles():
    chunks = [SeqChunk([7], 9, [3, 4, 5]), SeqChunk(list(range(19)), 4, [1, 2, 6, 8, 9, 10]),
              SeqChunk([5, 6], 0, [11])]
    b = prepare_batch(chunks, BS, tile_size=8)
    assert b.num_tokens == 22 and b.shape_key == (32, 32, 8, tile_capacity(32, 8)) == (32, 32, 8, 5)
    np.testing.assert_array_equal(b.input_ids[:22], [7] + list(range(19)) + [5, 6])
    np.testing.assert_array_equal(b.last_token[:3], [0, 19, 21])
    # The 19-token chunk is three tiles (8, 8, 3), the 2-token prompt one; the decode none.
    np.testing.assert_array_equal(b.tile_seq[:4], [1, 1, 1, 2])
    np.testing.assert_array_equal(b.tile_query_lens[:4], [8, 8, 3, 2])
    np.testing.assert_array_equal(b.tile_context_lens[:4], [4 + 8, 4 + 16, 4 + 19, 2])
    assert b.token_tile[0] == 5 and list(b.token_tile[1:22]) == [0] * 8 + [1] * 8 + [2] * 3 + [3] * 2
    assert (b.tile_seq[4:] == 32).all() and (b.tile_query_lens[4:] == 0).all()
    # A decode step has no tiles, and its rows are its sequences' bucket (no token minimum).
    d = prepare_batch([SeqChunk([1], 5, [2, 3]), SeqChunk([2], 3, [4])], BS, tile_size=8)
    assert d.shape_key == (2, 2, 4, 0)
    assert prepare_batch([SeqChunk([1], 5, [2, 3])], BS, tile_size=8).shape_key == (1, 1, 4, 0)


def test_a_step_splits_only_when_its_tiles_overflow():
    decodes = [SeqChunk([1], 5, [1, 2])] * 6
    assert split_steps(decodes + [SeqChunk([1] * 300, 0, list(range(80)))]) == [list(range(7))]
    many = [SeqChunk([1] * 3, 0, [1])] * 40  # 40 short prompts: 40 tiles, a 128-token bucket holds 5
    parts = split_steps(many)
    assert sum(parts, []) == list(range(40)) and len(parts) > 1
    for part in parts:
        n = sum(len(many[i].token_ids) for i in part)
        bucket = max(8, 1 << (n - 1).bit_length())
        assert sum(num_tiles(len(many[i].token_ids)) for i in part) <= tile_capacity(bucket)
        assert prepare_batch([many[i] for i in part], BS).shape_key[3] == tile_capacity(bucket)
    # Unsplit, the batch still holds every tile, in a shape of its own.
    assert prepare_batch(many, BS).shape_key == (128, 128, 4, 64)


def test_engine_runs_a_mixed_step_as_one_model_call(tiny_llama_dir, monkeypatch):
    """Streams decoding while a prompt arrives: with chunked prefill, each step is one call of the
    model over the decodes and the chunk together, and the streams get a token every step."""
    from paged_jax import LLM, SamplingParams
    from paged_jax.executor.model_runner import ModelRunner

    llm = LLM(tiny_llama_dir, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, max_model_len=128)
    engine = llm.llm_engine
    calls = []
    run = ModelRunner.run_step
    monkeypatch.setattr(ModelRunner, "run_step", lambda self, b, **kw: (calls.append(b.shape_key), run(self, b, **kw))[1])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", None, prompt_token_ids=[5 + i, 6, 7], sampling_params=greedy)
    engine.step()  # the three short prompts
    engine.add_request("long", None, prompt_token_ids=list(range(3, 50)), sampling_params=greedy)
    for _ in range(3):  # 47 tokens at 13 a step (16 less the 3 decodes): prefill chunks beside the decodes
        calls.clear()
        outs = engine.step()
        assert len(calls) == 1 and calls[0][3] > 0, calls  # one batch, with query tiles
        assert sorted(o.request_id for o in outs if o.outputs[0].token_ids) == ["s0", "s1", "s2"]
    # Tokens equal to each prompt run alone.
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    alone = llm.generate(prompt_token_ids=[list(range(3, 50)), [5, 6, 7]], sampling_params=greedy, use_tqdm=False)
    assert done["long"] == alone[0].outputs[0].token_ids and done["s0"] == alone[1].outputs[0].token_ids


@pytest.mark.parametrize("cfg", [(4, 32, 32, 8), (16, 100, 80, 16), (256, 256, 2048, 16)])
def test_warmup_shapes_are_few(cfg):
    """One step shape per (token bucket, table width) with prefill, one per (sequence bucket, table
    width) without: the (sequences x query-length) product of separate prompt batches is gone."""
    shapes = warmup_shapes(*cfg)
    assert len(shapes) == len(set(shapes))
    widths = {s[2] for s in shapes}
    assert len(shapes) == len({(t, b) for t, s, b, n in shapes if n}) + len({(s, b) for t, s, b, n in shapes if not n})
    assert len(shapes) <= 2 * 10 * len(widths)
