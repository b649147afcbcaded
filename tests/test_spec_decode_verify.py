"""Verification of drafts against the target's tokens: what it emits follows the target's
distribution (a chi-square test over many seeded draws of the real jitted sampler against the exact
law computed in numpy), and a seeded request emits the tokens plain decoding draws."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from paged_jax.executor.interface import Sample, position_histories
from paged_jax.sampler import sample
from paged_jax.sampling_params import SamplingParams
from paged_jax.sampling_tensors import SamplingTensors
from paged_jax.sequence import Sequence
from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.spec_decode.decoder import SpecDecoder, num_accepted

V = 6
PROMPT = [1, 2, 3]
OUTPUT = [4, 0]  # generated so far; the drafts follow
DRAFTS = [2, 5]
LOGITS = np.array([[0.3, -1.0, 1.2, 0.1, 0.8, -0.4],   # scores the token after OUTPUT (draft 0's position)
                   [1.0, 0.2, -0.5, 0.0, 0.4, 0.9],    # after draft 0 (draft 1's position)
                   [-0.2, 0.6, 0.3, 1.1, -1.5, 0.0]], np.float32)  # after draft 1 (the bonus token)
PARAMS = SamplingParams(temperature=0.8, top_k=5, seed=0)


def target_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The sampler's distribution for these parameters, computed independently."""
    z = logits.astype(np.float64) / p.temperature
    z = np.where(z >= np.sort(z)[-p.top_k], z, -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


def verify_draws(seeds: list[int], params: SamplingParams) -> list[tuple[int, ...]]:
    """For each seed: the target's tokens drawn at every scored position (one sampler call for all, as
    the model runner draws them), then the tokens SpecDecoder.verify emits."""
    output = OUTPUT + DRAFTS
    histories = position_histories(output, len(DRAFTS))
    rows, logit_rows = [], []
    for seed in seeds:
        for j, history in enumerate(histories):
            rows.append((SamplingParams(**{**_fields(params), "seed": seed}), seed, PROMPT, history))
            logit_rows.append(LOGITS[j])
    ids = _sample(np.stack(logit_rows), rows).reshape(len(seeds), len(histories))
    decoder = SpecDecoder(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": len(DRAFTS)}),
                          None, max_model_len=64, max_num_batched_tokens=64)
    out = []
    for targets in ids:
        seq = Sequence(0, PROMPT, output_token_ids=list(output))
        emitted = decoder.verify(seq, len(DRAFTS), [Sample(int(t), 0.0, None) for t in targets])
        assert seq.output_token_ids == OUTPUT and seq.num_computed_tokens == seq.get_len() + len(emitted) - 1
        out.append(tuple(smp.token_id for smp in emitted))
    return out


def _sample(logits: np.ndarray, rows: list) -> np.ndarray:
    """The jitted sampler's tokens for these rows, padded to at least 128 rows (one compiled shape per test)."""
    pad = max(128, 1 << (len(rows) - 1).bit_length())
    logits = np.concatenate([logits, np.zeros((pad - len(rows), V), np.float32)])
    return np.asarray(sample(logits, SamplingTensors.from_params(rows, V, pad_to=pad)).token_ids)[:len(rows)]


def _fields(p: SamplingParams) -> dict:
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "min_tokens": p.min_tokens}


def exact_law() -> dict[tuple[int, ...], float]:
    """P(emitted tokens): the first token follows p0; when it is draft 0 (probability p0(x0)) the
    next follows p1, and so on; a rejected draft's position emits p with the draft removed,
    renormalised, times the rejection probability: p itself off the draft."""
    law: dict[tuple[int, ...], float] = {}
    prefix, mass = (), 1.0
    for j in range(len(DRAFTS) + 1):
        p = target_probs(LOGITS[j], PARAMS)
        for t in range(V):
            if j < len(DRAFTS) and t == DRAFTS[j]:
                continue
            if p[t] > 0:
                law[prefix + (t,)] = mass * p[t]
        if j < len(DRAFTS):
            mass *= p[DRAFTS[j]]
            prefix += (DRAFTS[j],)
    return law


def test_num_accepted():
    assert num_accepted([3, 4, 5], [3, 4, 5, 6]) == 3
    assert num_accepted([3, 4, 5], [3, 9, 5, 6]) == 1
    assert num_accepted([3, 4, 5], [7, 4, 5, 6]) == 0
    assert num_accepted([], [7]) == 0


def test_position_histories():
    assert position_histories([7, 8, 1, 2], 2) == [[7, 8], [7, 8, 1], [7, 8, 1, 2]]


def test_emitted_tokens_follow_the_target_distribution():
    n = 6000
    draws = verify_draws(list(range(n)), PARAMS)
    law = exact_law()
    assert abs(sum(law.values()) - 1) < 1e-6
    impossible = [d for d in draws if d not in law]
    assert not impossible, f"outcomes outside the law: {impossible[:5]}"
    outcomes = sorted(law)
    counts = np.array([sum(d == o for d in draws) for o in outcomes])
    expected = np.array([law[o] for o in outcomes])
    expected *= n / expected.sum()
    assert expected.min() >= 5  # the chi-square approximation holds
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    # The rejection rule itself at the first draft: accepted with probability p0(x0); a rejection emits
    # p0 with x0 removed, renormalised.
    p0 = target_probs(LOGITS[0], PARAMS)
    accepted = np.mean([d[0] == DRAFTS[0] for d in draws])
    assert abs(accepted - p0[DRAFTS[0]]) < 4 * np.sqrt(p0[DRAFTS[0]] * (1 - p0[DRAFTS[0]]) / n)
    rejected = [d[0] for d in draws if d[0] != DRAFTS[0]]
    residual = np.delete(p0, DRAFTS[0]) / (1 - p0[DRAFTS[0]])
    keep = residual > 0
    counts = np.bincount(rejected, minlength=V)[np.delete(np.arange(V), DRAFTS[0])][keep]
    residual = residual[keep] / residual[keep].sum()
    assert stats.chisquare(counts, residual * len(rejected)).pvalue > 1e-3


@pytest.mark.parametrize("params", [PARAMS, SamplingParams(temperature=1.2, presence_penalty=0.7, min_tokens=4),
                                    SamplingParams(temperature=0)])
def test_seeded_verification_emits_what_plain_decoding_draws(params):
    """Plain decoding draws one token a step (its history growing by it); verification draws them all
    in one step. With the same seed, what verification emits is plain decoding's first tokens."""
    seeds = list(range(42))  # 126 verification rows: the plain steps' shape
    outputs = {seed: list(OUTPUT) for seed in seeds}
    plain = {seed: [] for seed in seeds}
    for j in range(len(DRAFTS) + 1):  # one plain decoding step for every seed still drawing
        going = [s for s in seeds if len(plain[s]) == j and (j == 0 or plain[s][-1] == DRAFTS[j - 1])]
        rows = [(SamplingParams(**{**_fields(params), "seed": s}), s, PROMPT, list(outputs[s])) for s in going]
        tokens = _sample(np.repeat(LOGITS[j][None], len(going), 0), rows)
        for s, t in zip(going, tokens):
            plain[s].append(int(t))
            outputs[s].append(int(t))
    for seed, emitted in zip(seeds, verify_draws(seeds, params)):
        assert tuple(plain[seed]) == emitted, seed
