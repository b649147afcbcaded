"""The jitted sampler against a plain numpy reference of vLLM 0.2/0.3 semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.outputs import CompletionOutput, RequestOutput, make_logprobs_dict
from paged_jax.sampler import (
    PAD_ID, SamplingTensors, sample, seed_for_sample, token_logprobs,
)
from paged_jax.sampling_params import SamplingParams

EOS = 2


# ---- numpy reference (float64, sort-based, one row at a time) ---------------------
def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _log_softmax(x):
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def ref_logprobs(logits, p: SamplingParams, prompt=(), output=(), eos=EOS):
    """Processed logprobs of one row, as vLLM computes them."""
    V = logits.shape[0]
    x = logits.astype(np.float64).copy()
    if len(output) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else [eos])
        x[banned] = -np.inf
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)[:V]
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    rep = np.where(seen, p.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if not (p.use_beam_search or p.temperature < 1e-5):
        x = x / p.temperature
        if 0 < p.top_k < V:  # keep >= the k-th largest (ties kept)
            kth = np.sort(x)[::-1][p.top_k - 1]
            x[x < kth] = -np.inf
        if p.top_p < 1:  # drop where mass(prob <= own) <= 1 - top_p, keep the max
            probs = _softmax(x)
            s = np.sort(probs)
            mass_le = np.cumsum(s)[np.searchsorted(s, probs, side="right") - 1]
            x[(mass_le <= 1 - p.top_p) & (probs < probs.max())] = -np.inf
        if p.min_p > 0:
            probs = _softmax(x)
            x[probs < p.min_p * probs.max()] = -np.inf
    return _log_softmax(x)


def full_logprobs(out, V):
    """The whole processed logprob vector of each row, from a num_top=V output."""
    ids, lps = np.asarray(out.top_token_ids), np.asarray(out.top_logprobs)
    full = np.full(ids.shape, np.nan)
    np.put_along_axis(full, ids, lps, axis=1)
    assert not np.isnan(full).any(), "top-V ids are not a permutation"
    return full


def assert_logprobs_close(got, want, atol=1e-5):
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), (
        f"masks differ at {np.nonzero(np.isfinite(got) != np.isfinite(want))}")
    f = np.isfinite(want)
    np.testing.assert_allclose(got[f], want[f], atol=atol, rtol=0)


def run(rows, logits, **kw):
    t = SamplingTensors.from_params(rows, logits.shape[1], pad_to=logits.shape[0], eos_token_id=EOS, **kw)
    return t, jax.device_get(sample(jnp.asarray(logits), t))


V = 1000  # not a multiple of the 256-token CDF block
_rng = np.random.default_rng(0)
PROMPT = list(_rng.integers(0, V, 40))
OUTPUT = list(_rng.integers(0, V, 25)) + [7, 7, 7]

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy_penalties": SamplingParams(temperature=0.0, repetition_penalty=1.5,
                                       presence_penalty=0.7, frequency_penalty=0.4),
    "temperature": SamplingParams(temperature=0.6),
    "hot": SamplingParams(temperature=1.7, presence_penalty=-1.0),
    "top_k": SamplingParams(temperature=0.9, top_k=20),
    "top_p": SamplingParams(temperature=1.5, top_p=0.7),
    "top_p_wide": SamplingParams(temperature=2.0, top_p=0.95),
    "min_p": SamplingParams(temperature=1.1, min_p=0.02),
    "everything": SamplingParams(temperature=1.3, top_k=50, top_p=0.85, min_p=0.01,
                                 repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.3),
    "min_tokens": SamplingParams(temperature=0.5, min_tokens=40, max_tokens=64, stop_token_ids=[11, 12]),
    "min_tokens_ignore_eos": SamplingParams(temperature=0.0, min_tokens=40, max_tokens=None, stop_token_ids=[13],
                                            ignore_eos=True),
    "beam": SamplingParams(use_beam_search=True, n=2, temperature=0.0, repetition_penalty=1.2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processed_logprobs_match_reference(name):
    p = CASES[name]
    S = 4
    rng = np.random.default_rng(hash(name) % 2**32)
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    logits[:, EOS] = 20.0  # EOS would win if not banned
    logits[:, 7] = 15.0  # the repeated output token
    rows = [(p, None, PROMPT, OUTPUT) for _ in range(S)]
    _, out = run(rows, logits, num_top=V, step=3)
    got = full_logprobs(out, V)
    for i in range(S):
        want = ref_logprobs(logits[i], p, PROMPT, OUTPUT)
        assert_logprobs_close(got[i], want)
        tok = int(out.token_ids[i])
        assert np.isfinite(want[tok]), "sampled a masked token"
        np.testing.assert_allclose(out.logprobs[i], want[tok], atol=1e-5)
        if p.temperature < 1e-5:
            assert tok == int(np.argmax(want))
    if p.min_tokens:
        banned = p.stop_token_ids + ([] if p.ignore_eos else [EOS])
        assert np.isneginf(got[:, banned]).all()
        if p.ignore_eos:
            assert (out.token_ids == EOS).all()


def test_reference_is_not_trivial():
    """The masks in CASES actually remove tokens, and penalties actually move logits,
    so agreement above means something."""
    logits = np.random.default_rng(1).standard_normal(V) * 3
    for name in ("top_k", "top_p", "top_p_wide", "min_p", "everything"):
        n_kept = np.isfinite(ref_logprobs(logits, CASES[name])).sum()
        assert 3 < n_kept < 0.9 * V, (name, n_kept)
    plain = ref_logprobs(logits, CASES["greedy"], PROMPT, OUTPUT)
    pen = ref_logprobs(logits, CASES["greedy_penalties"], PROMPT, OUTPUT)
    assert np.abs(plain - pen).max() > 0.5


def test_mixed_batch_each_row_its_own_params():
    names = list(CASES)
    S = len(names) + 3  # + padding
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    rows = []
    for i, n in enumerate(names):
        p = CASES[n]
        rows.append((p, None, PROMPT[: 5 + i], OUTPUT[: 3 + 2 * i]))
    t, out = run(rows, logits, num_top=V, step=11)
    assert (t.all_greedy, t.do_penalties, t.do_top_k, t.do_top_p, t.do_min_p) == (False, True, True, True, True)
    got = full_logprobs(out, V)
    for i, (p, _, pr, o) in enumerate(rows):
        want = ref_logprobs(logits[i], p, pr, o)
        assert_logprobs_close(got[i], want)
        if p.temperature < 1e-5:
            assert int(out.token_ids[i]) == int(np.argmax(want))


def test_greedy_fast_path_is_argmax_and_log_softmax():
    S = 16
    logits = (np.random.default_rng(2).standard_normal((S, 50257)) * 4).astype(np.float32)
    for num_top in (None, 4):
        rows = [(SamplingParams(temperature=0.0, logprobs=3 if num_top else None), None, [1], [])] * 10
        t, out = run(rows, logits, num_top=num_top)
        assert t.all_greedy and not t.do_penalties and t.num_top == (num_top or 0)
        lsm = np.stack([_log_softmax(r.astype(np.float64)) for r in logits])
        np.testing.assert_array_equal(out.token_ids[:10], np.argmax(logits[:10], axis=1))
        np.testing.assert_allclose(out.logprobs[:10], lsm[np.arange(10), out.token_ids[:10]], atol=1e-5)
        if num_top:
            np.testing.assert_array_equal(out.top_token_ids[:10], np.argsort(-logits[:10], axis=1)[:, :4])
        else:
            assert out.top_token_ids.shape == (S, 0)


def test_greedy_row_same_in_fast_path_and_mixed_batch():
    logits = (np.random.default_rng(3).standard_normal((4, V)) * 3).astype(np.float32)
    g = SamplingParams(temperature=0.0)
    _, fast = run([(g, None, [], [])] * 4, logits)
    rows = [(g, None, [], []), (CASES["everything"], None, PROMPT, OUTPUT), (g, None, [], []), (CASES["top_p"], None, [], [])]
    _, mixed = run(rows, logits)
    for i in (0, 2):
        assert fast.token_ids[i] == mixed.token_ids[i]
        np.testing.assert_allclose(fast.logprobs[i], mixed.logprobs[i], atol=1e-6)


def test_large_vocab_all_features_match_reference():
    Vb, S = 50257, 4
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((S, Vb)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=0.8, top_k=1000, top_p=0.5, min_p=0.001, repetition_penalty=1.1),
              SamplingParams(temperature=1.0, top_p=0.95, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=1.3, top_k=5)]
    prompt, output = list(rng.integers(0, Vb, 300)), list(rng.integers(0, Vb, 50))
    rows = [(p, None, prompt, output) for p in params]
    _, out = run(rows, logits, num_top=Vb)
    got = full_logprobs(out, Vb)
    for i, p in enumerate(params):
        assert_logprobs_close(got[i], ref_logprobs(logits[i], p, prompt, output))


def test_top_k_and_top_p_keep_ties_together():
    x = np.full((1, 16), -5.0, np.float32)
    x[0, [3, 9, 12]] = 2.0
    x[0, 5] = 4.0
    _, out = run([(SamplingParams(top_k=2), None, [], [])], x, num_top=16)
    kept = set(np.asarray(out.top_token_ids)[0][np.isfinite(out.top_logprobs[0])].tolist())
    assert kept == {3, 5, 9, 12}
    # top_p: the top token holds 0.71 of the mass, the tied three 0.29, the rest 0.001.
    _, out = run([(SamplingParams(top_p=0.75), None, [], [])], x, num_top=16)
    kept = set(np.asarray(out.top_token_ids)[0][np.isfinite(out.top_logprobs[0])].tolist())
    assert kept == {3, 5, 9, 12}
    _, out = run([(SamplingParams(top_p=0.6), None, [], [])], x, num_top=16)
    kept = set(np.asarray(out.top_token_ids)[0][np.isfinite(out.top_logprobs[0])].tolist())
    assert kept == {5}


# ---- seeds -----------------------------------------------------------------------
def _seeded_token(logits_row, p, seed, n_generated):
    """The documented draw: u from fold_in(PRNGKey(seed), n), inverse CDF of the
    reference distribution."""
    u = float(jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed), n_generated), ()))
    probs = np.exp(ref_logprobs(logits_row, p))
    return int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))


def test_seeded_row_independent_of_batch_and_position():
    rng = np.random.default_rng(6)
    p = SamplingParams(temperature=1.0, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0.5, top_k=3, presence_penalty=0.5),
              SamplingParams(temperature=1.2, top_p=0.5, seed=99), SamplingParams(min_p=0.2)]
    generated = []
    for step in range(12):
        row = (rng.standard_normal(V) * 2).astype(np.float32)
        _, alone = run([(p, 1234, [5], list(generated))], row[None])
        batch = (rng.standard_normal((8, V)) * 2).astype(np.float32)
        batch[5] = row
        rows = [(others[j % len(others)], 99 if others[j % len(others)].seed else None, [1, 2], [3] * j)
                for j in range(8)]
        rows[5] = (p, 1234, [5], list(generated))
        _, crowd = run(rows, batch, step=step)
        assert int(alone.token_ids[0]) == int(crowd.token_ids[5])
        np.testing.assert_allclose(alone.logprobs[0], crowd.logprobs[5], atol=1e-6)
        assert int(alone.token_ids[0]) == _seeded_token(row, p, 1234, step)
        generated.append(int(alone.token_ids[0]))
    assert len(set(generated)) > 6  # the step is part of the key: draws vary


def test_different_seeds_differ_and_same_seed_repeats():
    logits = np.zeros((3, V), np.float32)  # uniform: every draw is the key's
    p = SamplingParams(temperature=1.0, seed=0)
    draws = {1: [], 2: [], 1_000_003: []}
    for n in range(30):
        rows = [(p, s, [], [0] * n) for s in draws]
        _, out = run(rows, logits)
        for s, tok in zip(draws, out.token_ids):
            draws[s].append(int(tok))
    a, b, c = draws.values()
    assert sum(x != y for x, y in zip(a, b)) > 25 and sum(x != y for x, y in zip(a, c)) > 25
    _, again = run([(p, 2, [], [0] * 17)], logits[:1])
    assert int(again.token_ids[0]) == b[17]
    # Large and negative seeds are taken modulo 2**64 and still differ.
    _, big = run([(p, 2**64 + 1, [], []), (p, 1, [], []), (p, -1, [], []), (p, 2**64 - 1, [], [])], np.zeros((4, V), np.float32))
    assert big.token_ids[0] == big.token_ids[1] and big.token_ids[2] == big.token_ids[3]


def test_seed_for_sample_and_missing_row_seed():
    assert seed_for_sample(42, 0) == 42
    seeds = {seed_for_sample(42, i) for i in range(50)}
    assert len(seeds) == 50
    with pytest.raises(ValueError, match="seed_for_sample"):
        SamplingTensors.from_params([(SamplingParams(seed=3), None, [], [])], V)


def test_unseeded_rows_get_distinct_keys_per_row_and_step():
    logits = np.zeros((8, V), np.float32)
    p = SamplingParams(temperature=1.0)
    _, a = run([(p, None, [], [])] * 8, logits, step=0)
    _, b = run([(p, None, [], [])] * 8, logits, step=1)
    _, c = run([(p, None, [], [])] * 8, logits, step=0, engine_seed=5)
    _, a2 = run([(p, None, [], [])] * 8, logits, step=0)
    assert len(set(a.token_ids.tolist())) == 8
    assert (a.token_ids != b.token_ids).sum() >= 7 and (a.token_ids != c.token_ids).sum() >= 7
    np.testing.assert_array_equal(a.token_ids, a2.token_ids)


@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_distribution_matches_processed_probs(seeded):
    """Many draws (deterministic keys, so this cannot flake) against the reference
    distribution: a chi-square well inside its tolerance, and far outside it for
    the unprocessed distribution (so the check has teeth)."""
    Vs, N = 700, 8192
    # 24 live tokens spread over three 256-token CDF blocks; the rest negligible.
    live = np.arange(24) * 29 + 3
    logits = np.full(Vs, -60.0, np.float32)
    logits[live] = np.random.default_rng(7).standard_normal(24) * 1.5
    p = SamplingParams(temperature=0.7, top_k=14, top_p=0.9, min_p=0.02, seed=0 if seeded else None)
    rows = [(p, i * 7919 if seeded else None, [], []) for i in range(N)]
    _, out = run(rows, np.tile(logits, (N, 1)), step=123)
    counts = np.bincount(out.token_ids, minlength=Vs)
    probs = np.exp(ref_logprobs(logits, p))
    kept = probs > 0
    assert 3 < kept.sum() < 24 and len({int(t) // 256 for t in np.nonzero(kept)[0]}) == 3
    assert counts[~kept].sum() == 0, "masked tokens were drawn"
    chi2 = ((counts[kept] - N * probs[kept]) ** 2 / (N * probs[kept])).sum()
    assert chi2 < 45, chi2  # df <= 13: p ~ 1e-5
    raw = _softmax(logits.astype(np.float64))
    chi2_raw = ((counts[live] - N * raw[live]) ** 2 / (N * raw[live])).sum()
    assert chi2_raw > 500, chi2_raw


# ---- top-N, padding, variants -------------------------------------------------------
def test_top_logprobs_are_the_n_largest_sorted():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((6, V)) * 3).astype(np.float32)
    ps = [SamplingParams(logprobs=5), SamplingParams(temperature=0, logprobs=3),
          SamplingParams(top_k=3, logprobs=5), SamplingParams(repetition_penalty=1.5, logprobs=1),
          SamplingParams(logprobs=0), SamplingParams(top_p=0.2, logprobs=2)]
    rows = [(p, None, PROMPT, OUTPUT) for p in ps]
    t, out = run(rows, logits)
    assert t.num_top == 8  # max logprobs (5) rounded up to a power of two
    for i, p in enumerate(ps):
        want = ref_logprobs(logits[i], p, PROMPT, OUTPUT)
        order = np.argsort(-want, kind="stable")[:8]
        np.testing.assert_allclose(out.top_logprobs[i], want[order], atol=1e-5)
        assert np.all(out.top_logprobs[i][:-1] >= out.top_logprobs[i][1:])
        fin = np.isfinite(want[order])
        np.testing.assert_array_equal(out.top_token_ids[i][fin], order[fin])
        entry = make_logprobs_dict(out.token_ids[i], out.logprobs[i], out.top_token_ids[i],
                                   out.top_logprobs[i], num=p.logprobs)
        assert list(entry)[0] == int(out.token_ids[i])
        assert set(entry) == {int(out.token_ids[i])} | set(order[: p.logprobs].tolist())
        assert all(type(k) is int and type(v) is float for k, v in entry.items())


def test_num_top_buckets_and_beam_width():
    t = SamplingTensors.from_params([(SamplingParams(), None, [], [])], V)
    assert t.num_top == 0
    t = SamplingTensors.from_params([(SamplingParams(logprobs=20), None, [], [])], V)
    assert t.num_top == 32
    t = SamplingTensors.from_params([(SamplingParams(use_beam_search=True, n=2, best_of=3, temperature=0), None, [], [])], V)
    assert t.num_top == 8 and t.all_greedy
    t = SamplingTensors.from_params([(SamplingParams(logprobs=20), None, [], [])], 10)
    assert t.num_top == 10


def test_padded_rows_do_not_affect_real_rows():
    rng = np.random.default_rng(9)
    real = (rng.standard_normal((3, V)) * 3).astype(np.float32)
    rows = [(CASES["everything"], None, PROMPT, OUTPUT), (SamplingParams(seed=4), 4, [], [1]),
            (CASES["greedy"], None, [], [])]
    _, small = run(rows, real, step=2, num_top=4)
    for fill in (np.nan, 1e30, -np.inf, 0.0):
        padded = np.concatenate([real, np.full((5, V), fill, np.float32)])
        padded[4, 17] = 3e38
        t, big = run(rows, padded, step=2, num_top=4)
        assert t.batch_size == 8
        np.testing.assert_array_equal(small.token_ids, big.token_ids[:3])
        np.testing.assert_allclose(small.logprobs, big.logprobs[:3], atol=1e-6)
        np.testing.assert_array_equal(small.top_token_ids, big.top_token_ids[:3])
        np.testing.assert_allclose(small.top_logprobs, big.top_logprobs[:3], atol=1e-6)


def test_from_params_layout_and_flags():
    p = SamplingParams(temperature=0.5, top_k=V + 5, presence_penalty=0.3, min_tokens=3, stop_token_ids=[9])
    t = SamplingTensors.from_params([(p, None, [1, 2, 3], [4]), (SamplingParams(temperature=0), None, [5], [])],
                                    V, pad_to=4, eos_token_id=EOS)
    assert t.top_k.tolist() == [V] * 4  # top_k >= V is off
    assert (t.do_top_k, t.do_top_p, t.do_min_p, t.do_penalties, t.all_greedy) == (False, False, False, True, False)
    assert t.greedy.tolist() == [False, True, True, True]
    assert t.prompt_token_ids.shape == (4, 0)  # no repetition penalty: no prompt ids sent
    assert t.output_token_ids.shape == (4, 16) and t.output_token_ids[0, :2].tolist() == [4, PAD_ID]
    assert t.banned_token_ids[0, :2].tolist() == [9, EOS] and (t.banned_token_ids[1:] == PAD_ID).all()
    with pytest.raises(ValueError, match="pad_to"):
        SamplingTensors.from_params([(p, None, [], [])] * 3, V, pad_to=2)
    with pytest.raises(ValueError, match="rows"):
        sample(jnp.zeros((3, V)), t)


def test_compiles_once_per_variant():
    Vc = 777  # a shape no other test uses, so the cache starts empty for it
    logits = jnp.asarray(np.random.default_rng(10).standard_normal((4, Vc)).astype(np.float32))
    rows = lambda temp, k: [(SamplingParams(temperature=temp, top_k=k), None, [], [])] * 4
    sample(logits, SamplingTensors.from_params(rows(0.7, 5), Vc))
    before = sample._cache_size()
    for temp, k in [(0.3, 9), (1.5, 2), (0.9, 100)]:  # values change, variant does not
        sample(logits, SamplingTensors.from_params(rows(temp, k), Vc, step=k))
    assert sample._cache_size() == before
    sample(logits, SamplingTensors.from_params(rows(0.7, -1), Vc))  # no top-k: a new variant
    assert sample._cache_size() == before + 1


def test_token_logprobs_for_prompts():
    logits = (np.random.default_rng(11).standard_normal((5, V)) * 2).astype(np.float32)
    ids = np.array([3, 1, 4, 1, 5])
    lp, top_ids, top_lps = jax.device_get(token_logprobs(jnp.asarray(logits), jnp.asarray(ids), num_top=2))
    lsm = np.stack([_log_softmax(r.astype(np.float64)) for r in logits])
    np.testing.assert_allclose(lp, lsm[np.arange(5), ids], atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-lsm, axis=1)[:, :2])


def test_outputs_dataclasses():
    c = CompletionOutput(0, "hi", [1, 2], -1.5, [{1: -0.5}, {2: -1.0}])
    assert not c.finished()
    c.finish_reason = "length"
    assert c.finished()
    r = RequestOutput("req-1", "p", [7], None, [c], True)
    s = repr(r)
    assert "request_id='req-1'" in s and "finish_reason=length" in s and "text='hi'" in s
    assert make_logprobs_dict(5, -0.1, [3, 5, 8], [-0.05, -0.1, -3.0], num=2) == {5: -0.1, 3: -0.05}


def test_untruncated_rows_keep_every_token_in_a_truncating_batch():
    """Rows with top_k/top_p/min_p off go through the truncation code of a batch
    that uses it; even tokens whose probability underflows to 0 keep a finite logprob."""
    x = np.stack([np.linspace(-150.0, 0.0, V), np.random.default_rng(12).standard_normal(V)]).astype(np.float32)
    rows = [(SamplingParams(temperature=1.0), None, [], []),
            (SamplingParams(temperature=0.5, top_k=10, top_p=0.5, min_p=0.1), None, [], [])]
    t, out = run(rows, x, num_top=V)
    assert t.do_top_k and t.do_top_p and t.do_min_p
    got = full_logprobs(out, V)
    want = ref_logprobs(x[0], rows[0][0])
    assert np.isfinite(got[0]).all()
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("V,chunk", [(50, 1024), (4096, 1024), (5000, 1024), (37, 8), (33, 8)])
def test_two_level_argmax_is_numpys_argmax(V, chunk):
    from paged_jax.sampler import _argmax

    rng = np.random.default_rng(V)
    x = rng.standard_normal((12, V)).astype(np.float32)
    x[1] = -np.inf  # all -inf: index 0
    x[2, [3, V - 1]] = 9.0  # a tie far apart: the first
    x[3, V - 1] = x[3, max(V - chunk - 1, 0)] = 9.0  # a tie between the short last chunk and the chunk before it: the earlier one
    x[4, V - 2] = np.nan  # a NaN wins, as in np.argmax
    x[5, [1, V - 1]] = np.nan
    x[6] = 0.0  # all equal
    x[7, V - 1] = 9.0  # the maximum in the short last chunk
    got = np.asarray(jax.jit(_argmax, static_argnums=1)(jnp.asarray(x), chunk))
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))
