"""Sampled drafts (a draft model serving a sampled request): drafts drawn from the draft's processed
distribution q, verified by the general rejection sampler against the target's p. What is emitted
follows the target's distribution (a chi-square test on a small vocabulary through the real pieces:
the draft loop's draws from the sampler's processed_probs, SpecDecoder.verify), and the test tells a
wrong q apart; in the engine, the target as its own draft has every sampled draft accepted (q equals p: the
same processing on both sides), a seeded request is reproducible, and every block comes back."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy import stats

from paged_jax import LLM, SamplingParams
from paged_jax.executor.interface import Sample
from paged_jax.sampler import processed_probs
from paged_jax.sampling_tensors import SamplingTensors
from paged_jax.sequence import Sequence
from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.spec_decode.decoder import SpecDecoder
from paged_jax.spec_decode.sampled import DRAFT, SampledDrafts, draw, position_rng

V, K = 6, 2
PROMPT, OUTPUT = [1, 2, 3], [4, 0]
TARGET = np.array([[0.3, -1.0, 1.2, 0.1, 0.8, -0.4],   # the target's logits at draft 0's position,
                   [1.0, 0.2, -0.5, 0.0, 0.4, 0.9],    # at draft 1's,
                   [-0.2, 0.6, 0.3, 1.1, -1.5, 0.0]], np.float32)  # after the last draft
DRAFT_LOGITS = np.array([[0.9, 0.1, 0.2, -0.3, 1.0, 0.0],
                         [0.1, 0.5, 0.5, 0.2, -0.2, 1.3]], np.float32)
PARAMS = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampler's processed distribution of each logits row (no history: no penalties here)."""
    rows = [(params, None, PROMPT, OUTPUT)] * len(logits)
    return np.asarray(processed_probs(logits, SamplingTensors.from_params(rows, V, pad_to=len(logits))))


def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """temperature, top-k, then vLLM's top-p, in float64 numpy (an independent check of processed_probs)."""
    z = logits.astype(np.float64) / p.temperature
    z = np.where(z >= np.sort(z)[-p.top_k], z, -np.inf)
    e = np.exp(z - z.max())
    e /= e.sum()
    keep = np.array([e[e <= x].sum() > 1 - p.top_p for x in e]) | (e == e.max())
    e = np.where(keep, e, 0.0)
    return e / e.sum()


def emitted(drafts: np.ndarray, q_told: np.ndarray) -> list[tuple[int, ...]]:
    """For seeds 0..n-1: seed s's drafts ``drafts[s]`` verified by SpecDecoder.verify told ``q_told[s]``;
    the tokens each row emits."""
    p = probs(TARGET, PARAMS)
    decoder = SpecDecoder(SpeculativeConfig.from_dict({"model": "draft", "num_speculative_tokens": K}),
                          None, max_model_len=64, max_num_batched_tokens=64)
    out = []
    for seed, row in enumerate(drafts):
        seq = Sequence(0, PROMPT, output_token_ids=[*OUTPUT, *(int(t) for t in row)])
        decoder.sampled[0] = SampledDrafts(q_told[seed], seed, None)
        got = decoder.verify(seq, K, [Sample(0, 0.0, None, probs=p[j]) for j in range(K + 1)])
        assert seq.output_token_ids == OUTPUT and seq.num_computed_tokens == seq.get_len() + len(got) - 1
        out.append(tuple(s.token_id for s in got))
    return out


def position_pvalues(tokens: list[tuple[int, ...]]) -> list[float]:
    """Per position: the chi-square p-value of the tokens emitted there against plain sampling's law
    (the target's distribution at that position; its logits do not depend on the tokens before)."""
    target = [reference(row, PARAMS) for row in TARGET]
    pvalues = []
    for m in range(K + 1):
        at_m = np.array([t[m] for t in tokens if len(t) > m])
        counts = np.bincount(at_m, minlength=V)
        support = target[m] > 0
        assert counts[~support].sum() == 0, f"position {m}: a token of target probability zero was emitted"
        pvalues.append(stats.chisquare(counts[support], target[m][support] * len(at_m)).pvalue)
    return pvalues


def test_processed_probs_is_the_samplers_distribution():
    for logits in (*TARGET, *DRAFT_LOGITS):
        np.testing.assert_allclose(probs(logits[None], PARAMS)[0], reference(logits, PARAMS), atol=1e-6)


@functools.cache
def stand_in_loop():
    """The jitted draft loop over a stand-in step whose logits at draft j's position are DRAFT_LOGITS[j]
    (the pending token's position: step j gives draft j)."""
    import jax.numpy as jnp

    from paged_jax.executor.decode_loop import make_decode_loop
    from paged_jax.executor.model_runner import StepOutput

    table = jnp.asarray(np.concatenate([DRAFT_LOGITS, np.zeros((1, V), np.float32)]))

    def step(params, kv, batch, all_logits):
        return StepOutput(table[jnp.clip(batch.positions - START, 0, K)]), kv

    return make_decode_loop(step, 4, K + 1, V)


START = len(PROMPT) + len(OUTPUT) - 1


def loop_drafts(seeds: range) -> tuple[np.ndarray, np.ndarray]:
    """Each seed's K drafts as the proposer draws them, by the draft loop (one call, a row per seed,
    uniforms from position_rng), and the q it returns: int[rows, K], float[rows, K, V]."""
    import jax.numpy as jnp

    from paged_jax.executor.decode_loop import loop_batch, loop_draws

    n = len(seeds)
    batch, limits = loop_batch([OUTPUT[-1]] * n, [START] * n, [[1, 2]] * n, [K + 1] * n, block_size=4)
    u = np.array([[position_rng(s, len(OUTPUT) + j, DRAFT, None).random() for s in seeds] for j in range(K + 1)])
    draws = loop_draws([(PARAMS, s, PROMPT, OUTPUT) for s in seeds], batch.block_tables.shape[0], K + 1, V, u)
    tokens, _, q, _ = stand_in_loop()(None, jnp.zeros(1), batch, limits, draws)
    return np.asarray(tokens)[:K, :n].T, np.asarray(q)[:K, :n].transpose(1, 0, 2)


def test_sampled_drafts_emit_the_targets_distribution_and_a_wrong_q_is_told_apart():
    """Drafts drawn by the draft loop: its q is the sampler's processed distribution, its drafts are
    the ones drawn one at a time on the host from that q with the same seed (sampled.draw at
    position_rng's uniform: a draft drawn outside the loop), and verified they emit the target's
    distribution at every position."""
    n = 6000
    drafts, q = loop_drafts(range(n))
    np.testing.assert_allclose(q, np.broadcast_to(probs(DRAFT_LOGITS, PARAMS), q.shape), atol=1e-6)
    assert drafts.tolist() == [[draw(q[s, j], position_rng(s, len(OUTPUT) + j, DRAFT, None)) for j in range(K)]
                               for s in range(n)]
    good = emitted(drafts, q)
    assert min(position_pvalues(good)) > 1e-3
    assert 0.2 < np.mean([len(t) > 1 for t in good]) < 0.9  # drafts are accepted and rejected
    # The same drafts verified against a q they were not drawn from (one that thinks them uniform):
    # the first position's tokens no longer follow the target.
    wrong = emitted(drafts, np.full_like(q, 1.0 / V))
    assert position_pvalues(wrong)[0] < 1e-6


def test_seeded_draws_are_reproducible_and_differ_by_seed():
    drafts, q = loop_drafts(range(50))
    again, _ = loop_drafts(range(50))
    assert np.array_equal(drafts, again) and emitted(drafts, q) == emitted(again, q)
    assert len({tuple(t) for t in emitted(drafts, q)}) > 5


# 19 s: -m slow; the acceptance rule's distribution is checked by default above
@pytest.mark.slow
def test_the_target_as_its_own_sampled_draft_has_every_draft_accepted(tiny_llama_dir):
    """q equals p when the draft is the target (the same processing of the same logits on both
    sides): every sampled draft is accepted. Seeded requests give the same tokens run again, with
    logprobs as asked; every block comes back."""
    target = str(tiny_llama_dir)
    kw = dict(block_size=4, num_kv_blocks=32, max_model_len=64, max_num_seqs=4,
              speculative_config={"model": target, "num_speculative_tokens": 3})
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True,
                             logprobs=2, presence_penalty=0.3) for s in range(3)]
    prompts = ["def f(x):\n", "import os\n", "for i in"]
    llm = LLM(target, **kw)
    first = llm.generate(prompts, params, use_tqdm=False)
    stats_ = llm.llm_engine.get_stats()["spec_decode"]
    assert stats_["num_drafts"] > 0 and stats_["acceptance_rate"] >= 0.98, stats_
    again = LLM(target, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert len({tuple(o.outputs[0].token_ids) for o in first}) == 3
    for o in first:
        c = o.outputs[0]
        assert len(c.token_ids) == 16 and len(c.logprobs) == 16
        assert all(t in entry and len(entry) <= 3 and entry[t] <= 0 for t, entry in zip(c.token_ids, c.logprobs))
    engine = llm.llm_engine
    engine.block_manager.check_invariants()
    engine.block_manager.reset_prefix_cache()
    bm = engine.block_manager.gpu_allocator
    assert bm.num_free_blocks == bm.num_total_blocks

