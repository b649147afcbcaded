"""Layer groups (one block table per attention kind, one pool of pages): the layout a model's layers
get, the hybrid block manager's prefix hits across groups, and Gemma 3 through the engine: its
windowed layers' blocks freed while it decodes, its greedy tokens still transformers'."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.memory import NULL_BLOCK, AllocStatus, HybridBlockManager, kv_layout
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus


def test_layouts_of_one_kind_and_of_gemma():
    one = kv_layout([None] * 4)
    assert one.windows == (None,) and one.layer_group == (0,) * 4 and one.layer_slot == (0, 1, 2, 3)
    assert kv_layout([4] * 3).windows == (4,)  # Mistral: one group, freed by its window
    assert kv_layout([4] * 3, groups=False).windows == (None,)
    # Gemma 3 1B: 26 layers, every sixth global: 22 windowed and 4 global, pages of 2 layers
    gemma3 = kv_layout([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert gemma3.num_slots == 2 and gemma3.windows == (512,) * 11 + (None,) * 2
    assert [gemma3.layer_group[i] for i in (0, 1, 2, 5, 11, 25)] == [0, 0, 1, 11, 11, 10]
    # every (group, slot) pair is one layer's
    assert len(set(zip(gemma3.layer_group, gemma3.layer_slot))) == 26
    # Gemma 2: windowed and global alternate: two groups of all their layers
    gemma2 = kv_layout([4096, None] * 13)
    assert gemma2.windows == (4096, None) and gemma2.num_slots == 13
    mixed = kv_layout([8, 8, 8, 8, 8, None], groups=False)  # the one-pool layout: every block kept
    assert mixed.windows == (None,) and mixed.num_slots == 6


def _request(rid: str, tokens: list[int]) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence(int(rid[1:]), tokens)])


def _run(bm, group: SequenceGroup, new_tokens: int = 0) -> None:
    """Admit, compute the prompt, decode ``new_tokens`` tokens, register the computed blocks."""
    seq = group.seqs[0]
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.get_len()
    for t in range(new_tokens):
        seq.append_token_id(t % 3)
        bm.append_slots(seq)
        seq.num_computed_tokens = seq.get_len()
    bm.mark_blocks_computed(seq)
    bm.check_invariants()


def test_a_prefix_hit_needs_every_groups_blocks():
    """A windowed group frees its leading blocks as the sequence decodes; once the pool has evicted
    them, a request with the same prefix hits nothing, though the full-attention group still has it
    cached; with every group's blocks cached it hits them all."""
    bm = HybridBlockManager(2, 40, 0, windows=(3, None), enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first = _request("r0", list(prompt))
    _run(bm, first)
    bm.free(first.seqs[0])
    hit = bm.plan_allocation(_request("r1", prompt + [9])).plans  # both groups cached: 4 blocks hit in each
    assert [len(p.seqs[0].cached) for p in hit] == [4, 4]

    long = _request("r2", list(prompt))
    _run(bm, long, new_tokens=12)  # decoding frees the windowed group's leading blocks
    assert bm.get_num_freed_blocks(long.seqs[0], 0) > 0 and bm.get_num_freed_blocks(long.seqs[0], 1) == 0
    assert bm.get_block_table(long.seqs[0], 0)[0] == NULL_BLOCK
    bm.reset_prefix_cache()  # the freed (windowed) blocks go; the full group's stay held by r2
    bm.free(long.seqs[0])  # now the full group's blocks are cached, the windowed group's first ones not
    late = _request("r3", prompt + [9])
    plans = bm.plan_allocation(late).plans
    assert [len(p.seqs[0].cached) for p in plans] == [0, 0]
    bm.allocate(late)
    assert late.seqs[0].num_computed_tokens == 0  # no hit taken: every group computes the prompt
    bm.check_invariants()


def test_windowed_groups_take_a_prompts_blocks_chunk_by_chunk():
    """A 3-token window beside full attention, blocks of 2, a step budget of 4 tokens, 14 usable pages:
    admission of a 20-token prompt takes the full group's 10 blocks and the windowed group's first
    chunk's 2 (12, where the whole prompt's 20 never fit); each later chunk frees the blocks the window
    has passed before taking the next, so the prompt and a decoded token run with no page free, and
    the windowed group never holds more than its window's and a chunk's blocks: ceil((3 + 4 + 1) / 2)."""
    prompt = list(range(1, 21))
    whole = HybridBlockManager(2, 15, 0, windows=(3, None))
    assert whole.can_allocate(_request("r0", prompt)) is AllocStatus.NEVER
    bm = HybridBlockManager(2, 15, 0, windows=(3, None), max_num_batched_tokens=4)
    group = _request("r1", prompt)
    assert bm.plan_allocation(group).num_blocks_taken == 12 and bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    held, free = [], []
    for step in range(6):  # five chunks of the prompt, then one decoded token
        if step == 5:
            seq.append_token_id(7)
        assert bm.can_append_slots(group)  # the blocks the window frees count: net, it needs none
        bm.append_slots(seq)
        bm.check_invariants()
        held.append(len(bm.get_block_table(seq, 0)) - bm.get_num_freed_blocks(seq, 0))
        free.append(bm.get_num_free_gpu_blocks())
        seq.num_computed_tokens = min(seq.get_len(), seq.num_computed_tokens + 4)
    assert free[1:] == [0] * 5 and max(held) == 4
    tables = bm.get_block_table(seq)
    assert [len(t) for t in tables.per_group] == [11, 11] and NULL_BLOCK not in tables.per_group[1]
    # In 7 pages a 10-token prompt's first chunk fits (5 + 2 blocks), but not its window's and a chunk's
    # 4 beside the 5 of the full group, which it would reach: refused, not admitted to stall.
    small = HybridBlockManager(2, 8, 0, windows=(3, None), max_num_batched_tokens=4)
    assert small.plan_allocation(_request("r2", prompt[:10])).num_blocks_taken == 7
    assert small.can_allocate(_request("r2", prompt[:10])) is AllocStatus.NEVER


@pytest.fixture(scope="module")
def gemma3(hf_model_dir):
    from tests.hf_models import load_hf

    path = hf_model_dir("gemma3")
    return path, load_hf(path)


def test_gemma3_frees_windowed_blocks_and_keeps_transformers_tokens(gemma3):
    """A 30-token prompt in 8-token chunks and 12 new tokens over 4-token blocks: admission takes the
    global layer's 8 blocks and each windowed layer's (window 6) first chunk's 2; while the prompt is
    computed a windowed layer holds at most its window's and a chunk's blocks, ceil((6 + 8 + 3) / 4),
    and at most 3 once decoding, the global layer all 11; every token equals transformers' greedy
    ``generate``."""
    import torch

    from paged_jax import SamplingParams
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs

    path, hf = gemma3
    prompt = np.random.default_rng(3).integers(3, hf.config.vocab_size, size=30).tolist()
    engine = LLMEngine(EngineArgs(model=str(path), block_size=4, max_model_len=64, max_num_seqs=2,
                                  max_num_batched_tokens=8))
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager) and bm.windows == (6,) * 5 + (None,)
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       prompt_token_ids=prompt)
    seq = engine._groups["a"].seqs[0]
    held, done = [], []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        bm.check_invariants()
        if bm.has_seq(seq):
            held.append((bm.get_group_usage(), len(bm.get_block_table(seq, 5))))
    assert held[0] == ([2] * 5 + [8], 8)  # the first chunk's blocks in the windowed groups, the prompt's in the global
    assert all(max(usage[:5]) <= 5 for usage, _ in held)
    usage, num_blocks = held[-1]
    assert num_blocks >= 10 and usage[5] == num_blocks  # the global layer keeps every block
    assert all(n <= 3 for n in usage[:5])  # a window of 6 spans at most 3 blocks of 4
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_total_blocks
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 30, dtype=torch.long),
                           do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert list(done[0].outputs[0].token_ids) == want[0, 30:].tolist()


def test_simulated_pool_per_kind_holds_the_window_and_more_sequences():
    """The benchmark's run at small sizes (window 64, 512-token contexts, blocks of 16): the simulator's
    per-group count of the pages running rows hold is the window's blocks in the windowed groups and
    every block in the global one, and a pool of the same bytes runs about 3x the sequences while
    requests wait. The arithmetic: ceil(64 / 16) + 1 = 5 pages per windowed group, 32 for the global."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import bench_hybrid_memory as bench

    a = SimpleNamespace(window=64, context=512, output_len=128, block_size=16)
    mc = bench.gemma3_config(a.window, a.context)
    one, grouped = bench.run(mc, a, False, 2, 2), bench.run(mc, a, True, 2, 2)
    assert one["per_group"] == [2 * 32] and grouped["per_group"] == [2 * 5] * 5 + [2 * 32]
    assert one["blocks_in_use"] == 64 and grouped["blocks_in_use"] == (5 * 10 + 64) / 6
    # 16 requests in the bytes of 4 full-length sequences in one pool (deterministic: 4.1 and 12.8 per
    # step while requests wait; the windowed groups hold 5 pages of 32, the bound is 1 / (1/6 + 5/6 x 5/32))
    one, grouped = bench.run(mc, a, False, 4, 16), bench.run(mc, a, True, 4, 16)
    assert grouped["mean_saturated"] > 2.5 * one["mean_saturated"] and grouped["peak_running"] >= 3 * 4


def test_requests_that_can_never_fit_are_refused_by_every_groups_blocks(gemma3):
    """35 pages of one layer, six groups (five with a window of 6 tokens, 3 blocks of 4 at most): a
    20-token prompt takes 6 x 5 pages at admission, and at n tokens ceil(n / 4) + 5 x 3; so at most
    80 tokens, 60 new ones."""
    from paged_jax import SamplingParams
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs

    path, _ = gemma3
    engine = LLMEngine(EngineArgs(model=str(path), block_size=4, max_model_len=96, num_kv_blocks=36))
    prompt = list(range(3, 23))
    refused = "need 36 blocks of 4 tokens, the cache holds 35; lower max_tokens to at most 60"
    with pytest.raises(ValueError, match=refused):
        engine.add_request("a", None, SamplingParams(max_tokens=61), prompt_token_ids=prompt)
    engine.add_request("b", None, SamplingParams(max_tokens=60), prompt_token_ids=prompt)


def _run_engine(path, requests, **kwargs) -> tuple[dict, "LLMEngine"]:
    """Run ``requests`` ({id: (prompt ids, SamplingParams)}) to the end, the block manager's
    invariants checked after every step; returns {id: the output token ids of each sample} and the engine."""
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs

    engine = LLMEngine(EngineArgs(model=str(path), block_size=4, max_model_len=96, **kwargs))
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    outs, freed = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [list(c.token_ids) for c in out.outputs]
        engine.block_manager.check_invariants()
        bm = engine.block_manager
        freed |= isinstance(bm, HybridBlockManager) and any(
            bm.get_num_freed_blocks(s, 0) for g in engine.scheduler.running for s in g.seqs if bm.has_seq(s))
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.block_manager.gpu_allocator.num_total_blocks
    engine.freed_windowed_blocks = freed
    return outs, engine


@pytest.mark.slow  # about 60 s alone: three engines compile the tiny Gemma 3
def test_gemma3_groups_under_preemption_prefix_caching_sampling_beams_and_speculation(gemma3):
    """Prompts sharing a prefix, greedy, seeded n = 2 sampling and beam search, in a pool of pages that
    preempts (swap, then recompute) with prefix caching, and with n-gram speculation: each request's
    tokens equal those of one pool keeping every block in a pool that never preempts."""
    from paged_jax import SamplingParams

    path, hf = gemma3
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, hf.config.vocab_size, size=12).tolist()
    prompts = [prefix + rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (2, 9, 17, 25, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = {f"g{i}": (p, greedy) for i, p in enumerate(prompts)}
    requests["s"] = (prompts[1], SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=40, ignore_eos=True))
    beams = {"b": (prompts[2], SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=12,
                                              ignore_eos=True))}
    want, one = _run_engine(path, {**requests, **beams}, free_blocks_outside_window=False, max_num_seqs=16)
    assert not isinstance(one.block_manager, HybridBlockManager)
    got, swap = _run_engine(path, {**requests, **beams}, num_kv_blocks=160, preemption_mode="swap",
                            enable_prefix_caching=True, max_num_seqs=16)
    assert got == want and sum(swap.scheduler.num_preemptions.values()) > 0 and swap.freed_windowed_blocks
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    got, rec = _run_engine(path, requests, num_kv_blocks=100, preemption_mode="recompute",
                           enable_prefix_caching=True, max_num_seqs=16, speculative_config=spec)
    assert got == {k: v for k, v in want.items() if k in requests}
    assert rec.scheduler.num_preemptions["recompute"] > 0 and rec.freed_windowed_blocks
