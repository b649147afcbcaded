"""Draft-model speculation: a second model over the target's block tables proposes the drafts; the
outputs equal plain decoding's (greedy, a stop string, max_tokens, seeded n = 2, preemption with prefix
caching), every block comes back, and a draft with another vocabulary is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.engine_args import EngineArgs
from paged_jax.models.tiny import make_tiny_model
from paged_jax.seeds import seed_for_sample
from tests.test_spec_decode_sampled import reference

PROMPTS = ["import os\nimport sys\nimport ", "def f(x):\n    return x\n\ndef g(", "for i in range(3):\n"]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A one-layer random model with the tiny target's tokenizer (its drafts are mostly wrong)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), family="llama", seed=1, num_hidden_layers=1)


def _check_all_blocks_back(engine):
    engine.block_manager.check_invariants()
    engine.block_manager.reset_prefix_cache()
    bm = engine.block_manager.gpu_allocator
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.slow
def test_draft_model_outputs_equal_plain_decoding(tiny_llama_dir, other_draft):
    """A mostly wrong draft: greedy outputs (with a stop string and a short max_tokens) equal plain
    decoding's, and seeded n = 2 sampled drafts (tests/test_spec_decode_sampled.py) give the same tokens
    run again, through preemption (swap, for the n = 2 group) with prefix caching."""
    target = str(tiny_llama_dir)
    kw = dict(block_size=4, num_kv_blocks=16, max_model_len=64, max_num_seqs=4, enable_prefix_caching=True)
    llm = LLM(target, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[10:13]]),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=3, max_tokens=16, ignore_eos=True)]
    expected = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    spec_config = {"model": str(other_draft), "num_speculative_tokens": 3}
    spec = LLM(target, speculative_config=spec_config, **kw)
    got = [[c.token_ids for c in o.outputs] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got[:2] == expected[:2]
    again = LLM(target, speculative_config=spec_config, **kw).generate(PROMPTS, params, use_tqdm=False)
    assert got[2] == [c.token_ids for c in again[2].outputs] and len(got[2]) == 2 and got[2][0] != got[2][1]
    stats = spec.llm_engine.get_stats()
    assert stats["spec_decode"]["method"] == "draft_model" and stats["spec_decode"]["num_drafts"] > 0
    assert sum(stats["num_preemptions"].values()) > 0
    _check_all_blocks_back(spec.llm_engine)


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(tiny_llama_dir):
    """The draft cache follows the target's through the same block tables (recompute preemption, a
    fully accepted row continuing after its last draft): the target's own weights as the draft propose
    exactly the target's greedy tokens."""
    target = str(tiny_llama_dir)
    spec = LLM(target, block_size=4, num_kv_blocks=16, max_model_len=64, max_num_seqs=4,
               speculative_config={"model": target, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, block_size=4, num_kv_blocks=64, max_model_len=64).generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = spec.llm_engine.get_stats()
    assert stats["num_preemptions"]["recompute"] > 0
    assert stats["spec_decode"]["acceptance_rate"] >= 0.95, stats["spec_decode"]
    assert stats["spec_decode"]["mean_acceptance_length"] > 3
    _check_all_blocks_back(spec.llm_engine)


def test_the_draft_loop_without_greedy_ids_from_the_step(tiny_llama_dir, monkeypatch):
    """Past GREEDY_IN_STEP_MAX_LOGITS (many rows, a large vocabulary) the step returns no greedy ids;
    the draft loop takes the argmax of the logits itself (here for every step: the limit set to 0)."""
    from paged_jax.executor import model_runner

    monkeypatch.setattr(model_runner, "GREEDY_IN_STEP_MAX_LOGITS", 0)
    target = str(tiny_llama_dir)
    spec = LLM(target, block_size=4, num_kv_blocks=64, max_model_len=64,
               speculative_config={"model": target, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(target, block_size=4, num_kv_blocks=64, max_model_len=64).generate(PROMPTS[:2], params, use_tqdm=False)
    got = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.llm_engine.get_stats()["spec_decode"]["acceptance_rate"] >= 0.95


def test_fork_copies_reach_the_draft_models_cache(tiny_llama_dir):
    """n > 1 without block sharing: the engine copies a request's blocks to each sample it forks, between
    steps, and makes the same copies in the draft's cache. The target as its own sampled draft then has
    every draft accepted (q equals p); with the draft's copies left out, stale blocks cut it to 0.67."""
    target = str(tiny_llama_dir)
    llm = LLM(target, block_size=4, num_kv_blocks=64, max_model_len=64, enable_block_sharing=False,
              speculative_config={"model": target, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs
    assert len(out) == 2 and out[0].token_ids != out[1].token_ids and all(len(c.token_ids) == 12 for c in out)
    stats = llm.llm_engine.get_stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["acceptance_rate"] >= 0.98, stats
    _check_all_blocks_back(llm.llm_engine)


def test_drafts_ban_eos_under_min_tokens_as_the_target_does(tiny_llama_dir):
    """A sampled request with min_tokens: the target's sampler bans EOS until then, and so do the
    draft's own step (a step with a prompt chunk: the first draft) and its loop (the drafts after it):
    each draft's q gives EOS no mass before min_tokens, and some after."""
    from paged_jax.spec_decode import draft_model

    target = str(tiny_llama_dir)
    llm = LLM(target, block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=16,
              speculative_config={"model": target, "num_speculative_tokens": 3})
    engine = llm.llm_engine
    eos, proposer = engine.eos_token_id, engine.spec_decoder.draft
    assert eos is not None
    records, propose = [], proposer.propose

    def recording_propose(out, limits, block_manager):
        before = {i: out.scheduled[i].seq.get_output_len() for i in limits}
        decode_only = draft_model._decode_only(out)
        drafts = propose(out, limits, block_manager)
        records.extend((before[i], proposer.probs[i], decode_only) for i in drafts if i in proposer.probs)
        return drafts

    proposer.propose = recording_propose
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=16, min_tokens=10)
    engine.add_request("a", PROMPTS[0], params)
    for _ in range(4):
        engine.step()
    engine.add_request("b", PROMPTS[1], params)  # its prompt chunks beside a's drafted decodes
    while engine.has_unfinished_requests():
        engine.step()
    assert any(d for *_, d in records) and any(not d for *_, d in records)  # the loop alone, and the first draft
    before = [q[j, eos] for n, q, _ in records for j in range(len(q)) if n + j < params.min_tokens]
    after = [q[j, eos] for n, q, _ in records for j in range(len(q)) if n + j >= params.min_tokens]
    assert before and after and max(before) == 0.0 and min(after) > 0.0, (max(before), min(after or [0]))
    _check_all_blocks_back(engine)


def test_the_pools_sized_from_memory_hold_the_draft_models_cache_too(tiny_llama_dir, other_draft, monkeypatch):
    """Without num_kv_blocks the pools' blocks come from the memory allowed (cpu_kv_cache_space on the CPU,
    swap_space for the host pool); the draft's caches have a block for each of the target's: the target's
    and the draft's arrays together fit what was allowed, and one more block each would not. The sizing
    is told the draft's weights, not loaded yet (an accelerator's share holds them: see the next test):
    the bytes of the arrays the draft then loads."""
    from paged_jax.executor import kv_sizing

    told, sizing = [], kv_sizing.available_kv_memory
    monkeypatch.setattr(kv_sizing, "available_kv_memory", lambda *a: told.append(a[3]) or sizing(*a))
    device, host = 300_000, 200_000  # bytes: a few dozen blocks, far under the pools' cap
    llm = LLM(str(tiny_llama_dir), max_model_len=64, cpu_kv_cache_space=device / 2 ** 30, swap_space=host / 2 ** 30,
              speculative_config={"model": str(other_draft), "num_speculative_tokens": 2})
    target, draft = llm.llm_engine.runner, llm.llm_engine.spec_decoder.draft.runner

    def nbytes(pool):
        return sum(int(a.nbytes) for layer in pool for a in layer)

    for pools, allowed in (((target.kv_caches, draft.kv_caches), device),
                           ((target.host_pool, draft.host_pool), host)):
        blocks = {a.shape[0] for pool in pools for layer in pool for a in layer}
        assert len(blocks) == 1, blocks  # the draft's pool has the target's block ids
        num_blocks = blocks.pop()
        used = sum(nbytes(pool) for pool in pools)
        assert used <= allowed < used + used // num_blocks, (used, allowed, num_blocks)
    assert told == [sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(draft.params))]


def test_an_accelerators_kv_share_leaves_out_the_weights_still_to_load(monkeypatch):
    """On an accelerator the KV cache gets gpu_memory_utilization of the device's memory less what is in
    use (the target's weights) and less the weights still to load (a draft model's)."""
    from paged_jax.executor import kv_sizing

    class Device:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 10_000, "bytes_in_use": 3_000}

    monkeypatch.setattr(kv_sizing.jax, "devices", lambda: [Device()])
    monkeypatch.setattr(kv_sizing.jax, "local_devices", lambda: [Device()])
    assert kv_sizing.available_kv_memory(0.9, 4, 1) == 6_000
    assert kv_sizing.available_kv_memory(0.9, 4, 1, 1_500) == 4_500
    assert kv_sizing.available_kv_memory(0.9, 4, 1, 7_000) == 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    draft = make_tiny_model(tmp_path / "small-vocab", family="llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 512"):
        LLM(str(tiny_llama_dir), num_kv_blocks=8, max_model_len=64,
            speculative_config={"model": str(draft), "num_speculative_tokens": 2})


def test_a_draft_folder_that_cannot_load_is_named_as_the_draft(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]: model path .*missing.* is not a directory"):
        LLM(str(tiny_llama_dir), num_kv_blocks=8, max_model_len=64,
            speculative_config={"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})


@pytest.mark.parametrize("config", [{"method": "draft_model", "num_speculative_tokens": 2},
                                    {"method": "ngram", "model": "draft", "num_speculative_tokens": 2}])
def test_draft_model_method_and_model_go_together(config):
    with pytest.raises(ValueError, match="draft_model"):
        EngineArgs(speculative_config=config)


@pytest.mark.slow
def test_warm_up_compiles_the_draft_models_steps(tiny_llama_dir, other_draft):
    llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=16,
              speculative_config={"model": str(other_draft), "num_speculative_tokens": 2})
    engine = llm.llm_engine
    engine.warm_up(progress=False)
    draft = engine.spec_decoder.draft.runner
    compiled = engine.get_stats()["num_compilations"], draft.num_compilations
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert engine.get_stats()["spec_decode"]["num_drafts"] > 0
    assert (engine.get_stats()["num_compilations"], draft.num_compilations) == compiled
    assert engine.spec_decoder.draft.loops.compiled  # the draft loop: warmed shapes only (counted above)


def _processed(logits: np.ndarray, p: SamplingParams, history: list[int]) -> np.ndarray:
    """numpy, float64: a sampled row's q as the sampler defines it (min_tokens' ban of the stop ids, presence
    and frequency penalties over the output so far, temperature, top-k, vLLM's top-p)."""
    z = logits.astype(np.float64).copy()
    if len(history) < p.min_tokens:
        z[list(p.stop_token_ids)] = -np.inf
    counts = np.bincount(history, minlength=len(z))
    z -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return reference(z, p)  # then temperature, top-k, top-p


@pytest.mark.slow
def test_sampled_and_greedy_drafts_of_the_draft_loop_against_transformers(tiny_llama_dir, other_draft):
    """Greedy and sampled rows (penalties, min_tokens, n = 2, a max_tokens that leaves fewer than k
    drafts) share the draft loop's calls, in steps of decodes only and in steps with a prompt chunk
    (first draft from the draft's step, the rest from the loop). Every proposal against transformers
    running the draft model: a greedy row's drafts are its argmax; a sampled row's q is its processed
    distribution given the output and the drafts before (numpy), and its drafts are drawn from that q
    at position_rng's uniforms (sampled.draw): what drafting one token at a time draws, seed for seed."""
    import torch

    from paged_jax.spec_decode import draft_model
    from paged_jax.spec_decode.sampled import DRAFT, draw, is_sampled, position_rng, row_seed
    from tests.hf_models import load_hf

    k = 3
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, speculative_config={"model": str(other_draft), "num_speculative_tokens": k})
    proposer = llm.llm_engine.spec_decoder.draft
    records, calls = [], []
    propose, compiled_loop = proposer.propose, proposer.loops.compiled_loop

    def recording_propose(out, limits, block_manager):
        before = {i: list(out.scheduled[i].seq.output_token_ids) for i in limits}
        decode_only = draft_model._decode_only(out)
        drafts = propose(out, limits, block_manager)
        for i, n in drafts.items():
            row = out.scheduled[i]
            records.append((row, row.seq.prompt_token_ids, before[i], row.seq.output_token_ids[-n:],
                            proposer.probs.get(i), decode_only, limits[i]))
        return drafts

    def recording_compiled_loop(num_steps, params, kv, batch, limits, draws):
        rows = int((np.asarray(batch.query_lens) > 0).sum())
        calls.append(None if draws is None else np.asarray(draws.sampled)[:rows].tolist())
        return compiled_loop(num_steps, params, kv, batch, limits, draws)

    proposer.propose, proposer.loops.compiled_loop = recording_propose, recording_compiled_loop
    sampled = dict(temperature=0.9, top_k=50, top_p=0.9, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(seed=7, max_tokens=14, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=6,
                             stop_token_ids=[5, 9], **sampled),
              SamplingParams(n=2, seed=11, max_tokens=8, **sampled)]
    engine = llm.llm_engine
    engine.add_request("n2", "for i in", params[2])  # rows 0 and 1, then the greedy request's when they finish
    engine.add_request("greedy", "import os\n", params[0])
    for _ in range(3):
        engine.step()
    # Its prompt runs in a step beside the others' drafted decodes (as do the n = 2 forks' block copies).
    engine.add_request("penalties", "def f(x):\n    return x\n", params[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert any(c and True in c and False in c for c in calls)  # greedy and sampled rows in one loop call
    assert any(r[5] for r in records) and any(not r[5] for r in records)  # both kinds of steps drafted
    assert any(len(r[3]) < k for r in records)  # max_tokens left room for fewer than k drafts
    assert {row_seed(r[0]) for r in records if r[0].group.sampling_params.n == 2} == {
        seed_for_sample(11, 0), seed_for_sample(11, 1)}

    hf = load_hf(other_draft)
    for row, prompt, output, drafts, q, _, _ in records:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output + drafts])).logits[0].numpy()
        at = len(prompt) + len(output) - 1  # the pending token: its logits give the first draft
        if not is_sampled(row):
            assert q is None and drafts == [int(np.argmax(logits[at + j])) for j in range(len(drafts))]
            continue
        p = row.group.sampling_params
        assert q.shape == (len(drafts), logits.shape[1])
        for j, token in enumerate(drafts):
            history = output + drafts[:j]
            expected = _processed(logits[at + j], p, history)
            np.testing.assert_allclose(q[j], expected, atol=2e-5)
            assert token == draw(q[j], position_rng(row_seed(row), len(history), DRAFT, None))
            assert token == draw(expected, position_rng(row_seed(row), len(history), DRAFT, None))
    _check_all_blocks_back(llm.llm_engine)


@pytest.mark.slow
def test_warm_up_compiles_the_sampled_draft_loops(tiny_llama_dir, other_draft):
    """warm_up(sampling_params) compiles the draft loop drawing with those params too: a run of sampled
    and greedy requests then compiles nothing: no loop, no step, no sampler (the target's p and the
    draft's q outside the loop, the sampler's processed_probs, included)."""
    llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=16,
              speculative_config={"model": str(other_draft), "num_speculative_tokens": 2})
    engine = llm.llm_engine
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.warm_up([greedy, sampled], progress=False)
    proposer = engine.spec_decoder.draft
    warmed = dict(proposer.loops.compiled)
    compiled = engine.get_stats()["num_compilations"], proposer.runner.num_compilations
    llm.generate(PROMPTS, [sampled, greedy, sampled], use_tqdm=False)
    assert engine.get_stats()["spec_decode"]["num_drafts"] > 0
    assert proposer.loops.compiled == warmed
    assert (engine.get_stats()["num_compilations"], proposer.runner.num_compilations) == compiled
