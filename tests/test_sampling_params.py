"""SamplingParams: vLLM 0.2 defaults, validation of every field, normalisation."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of) == (1, 1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.use_beam_search is False
    assert (p.length_penalty, p.early_stopping) == (1.0, False)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.include_stop_str_in_output is False and p.ignore_eos is False
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.sampling_type is SamplingType.RANDOM


# (kwargs, field named in the message, another substring the message must hold)
BAD = [
    (dict(n=0), "n", "0"),
    (dict(n=-3), "n", "-3"),
    (dict(n="2"), "n", "'2'"),
    (dict(n=2.0), "n", "2.0"),
    (dict(n=True), "n", "True"),
    (dict(n=3, best_of=2), "best_of", "best_of=2"),
    (dict(best_of="3"), "best_of", "'3'"),
    (dict(best_of=1.5), "best_of", "1.5"),
    (dict(presence_penalty=2.5), "presence_penalty", "2.5"),
    (dict(presence_penalty=-2.01), "presence_penalty", "-2.01"),
    (dict(presence_penalty="0.1"), "presence_penalty", "'0.1'"),
    (dict(presence_penalty=float("nan")), "presence_penalty", "nan"),
    (dict(frequency_penalty=3), "frequency_penalty", "3"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "-2.5"),
    (dict(frequency_penalty=None), "frequency_penalty", "None"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "0.0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty", "-1.0"),
    (dict(repetition_penalty=2.5), "repetition_penalty", "2.5"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "inf"),
    (dict(temperature=-1.0), "temperature", "-1.0"),
    (dict(temperature=-1e-9), "temperature", "e-09"),
    (dict(temperature="hot"), "temperature", "'hot'"),
    (dict(temperature=True), "temperature", "True"),
    (dict(temperature=float("nan")), "temperature", "nan"),
    (dict(temperature=float("inf")), "temperature", "inf"),
    (dict(top_p=0.0), "top_p", "0.0"),
    (dict(top_p=1.01), "top_p", "1.01"),
    (dict(top_p=-0.5), "top_p", "-0.5"),
    (dict(top_p=[0.5]), "top_p", "[0.5]"),
    (dict(top_k=-2), "top_k", "-2"),
    (dict(top_k=2.0), "top_k", "2.0"),
    (dict(top_k="5"), "top_k", "'5'"),
    (dict(min_p=-0.1), "min_p", "-0.1"),
    (dict(min_p=1.5), "min_p", "1.5"),
    (dict(min_p="0"), "min_p", "'0'"),
    (dict(seed=1.5), "seed", "1.5"),
    (dict(seed="42"), "seed", "'42'"),
    (dict(seed=True), "seed", "True"),
    (dict(use_beam_search=1), "use_beam_search", "1"),
    (dict(use_beam_search="yes"), "use_beam_search", "'yes'"),
    (dict(length_penalty="1"), "length_penalty", "'1'"),
    (dict(length_penalty=float("nan")), "length_penalty", "nan"),
    (dict(early_stopping="sometimes"), "early_stopping", "'sometimes'"),
    (dict(early_stopping=1), "early_stopping", "1"),
    (dict(stop=3), "stop", "3"),
    (dict(stop=["a", 3]), "stop", "3"),
    (dict(stop=""), "stop", "''"),
    (dict(stop=["ok", ""]), "stop", "''"),
    (dict(stop_token_ids=5), "stop_token_ids", "5"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids", "-1"),
    (dict(stop_token_ids=["1"]), "stop_token_ids", "'1'"),
    (dict(stop_token_ids="12"), "stop_token_ids", "'12'"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output", "None"),
    (dict(ignore_eos="false"), "ignore_eos", "'false'"),
    (dict(max_tokens=0), "max_tokens", "0"),
    (dict(max_tokens=-5), "max_tokens", "-5"),
    (dict(max_tokens=16.0), "max_tokens", "16.0"),
    (dict(max_tokens="16"), "max_tokens", "'16'"),
    (dict(min_tokens=-1), "min_tokens", "-1"),
    (dict(min_tokens=1.0), "min_tokens", "1.0"),
    (dict(min_tokens=17), "min_tokens", "max_tokens=16"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens", "5"),
    (dict(logprobs=-1), "logprobs", "-1"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs", str(MAX_LOGPROBS + 1)),
    (dict(logprobs=1.0), "logprobs", "1.0"),
    (dict(logprobs="5"), "logprobs", "'5'"),
    (dict(prompt_logprobs=-2), "prompt_logprobs", "-2"),
    (dict(prompt_logprobs=100), "prompt_logprobs", "100"),
    (dict(prompt_logprobs=2.5), "prompt_logprobs", "2.5"),
    (dict(skip_special_tokens=0), "skip_special_tokens", "0"),
    (dict(spaces_between_special_tokens="True"), "spaces_between_special_tokens", "'True'"),
    # cross-field rules
    (dict(temperature=0.0, best_of=2), "best_of", "greedy"),
    (dict(temperature=0.0, n=2), "best_of", "greedy"),
    (dict(temperature=1e-6, n=1, best_of=3), "best_of", "greedy"),
    (dict(use_beam_search=True, best_of=1, temperature=0.0), "best_of", "beam search"),
    (dict(use_beam_search=True, n=2, temperature=0.5), "temperature", "beam search"),
    (dict(use_beam_search=True, n=2), "temperature", "1.0"),
    (dict(use_beam_search=True, n=2, temperature=0.0, top_p=0.9), "top_p", "0.9"),
    (dict(use_beam_search=True, n=2, temperature=0.0, top_k=5), "top_k", "5"),
    (dict(use_beam_search=True, n=2, temperature=0.0, min_p=0.1), "min_p", "0.1"),
    (dict(use_beam_search=True, n=2, temperature=0.0, early_stopping="always"), "early_stopping", "'always'"),
    (dict(length_penalty=0.5), "length_penalty", "0.5"),
    (dict(early_stopping=True), "early_stopping", "True"),
    (dict(early_stopping="never"), "early_stopping", "'never'"),
    (dict(structured_outputs={"regex": "a+"}), "structured_outputs", "got dict"),
]


@pytest.mark.parametrize("kwargs,field,fragment", BAD, ids=[f"{f}:{k}" for k, f, _ in BAD])
def test_invalid_field_raises_value_error_naming_it(kwargs, field, fragment):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert field in msg, msg
    assert fragment in msg, msg


def test_every_field_has_a_bad_value_in_the_table():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    covered = {field for _, field, _ in BAD}
    assert fields <= covered, fields - covered


def test_messages_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"best_of must be 1 when using greedy sampling"):
        SamplingParams(temperature=0, n=2)
    with pytest.raises(ValueError, match=r"\[0, 20\] \(max_logprobs\)"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match=r"n must be an int, got '2' \(str\)"):
        SamplingParams(n="2")


VALID = [
    dict(),
    dict(n=3),
    dict(n=2, best_of=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05),
    dict(temperature=0.0),
    dict(temperature=0, top_p=0.5, top_k=10, min_p=0.3),  # greedy: truncation ignored
    dict(presence_penalty=-2, frequency_penalty=2, repetition_penalty=2),
    dict(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=0.1),
    dict(top_k=0),
    dict(top_k=1),
    dict(top_p=1e-6, min_p=1.0),
    dict(seed=0),
    dict(seed=-7),
    dict(seed=2**70),
    dict(seed=np.int64(5), n=np.int32(2), best_of=np.int64(3)),
    dict(temperature=np.float32(0.5), top_p=np.float64(0.3)),
    dict(use_beam_search=True, n=2, temperature=0.0),
    dict(use_beam_search=True, best_of=4, n=2, temperature=0.0, length_penalty=0.7, early_stopping=True),
    dict(use_beam_search=True, best_of=4, temperature=0.0, early_stopping="never"),
    dict(use_beam_search=True, n=3, temperature=0.0, repetition_penalty=1.3),
    dict(stop="\n"),
    dict(stop=["a", "bc"], stop_token_ids=[0, 7], include_stop_str_in_output=True),
    dict(stop=("x",), stop_token_ids=(3,)),
    dict(ignore_eos=True, max_tokens=1),
    dict(max_tokens=None),
    dict(max_tokens=None, min_tokens=1000),
    dict(min_tokens=16),
    dict(logprobs=0, prompt_logprobs=0),
    dict(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS),
    dict(skip_special_tokens=False, spaces_between_special_tokens=False),
    dict(use_beam_search=np.bool_(False), ignore_eos=np.bool_(True)),
]


@pytest.mark.parametrize("kwargs", VALID, ids=[str(k) for k in VALID])
def test_valid_combinations_accepted(kwargs):
    p = SamplingParams(**kwargs)
    assert p.best_of >= p.n >= 1
    assert isinstance(p.stop, list) and isinstance(p.stop_token_ids, list)
    assert p.top_k == -1 or p.top_k >= 1


def test_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, np.int64(4))).stop_token_ids == [3, 4]
    assert type(SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids[0]) is int
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(n=3).best_of == 3
    p = SamplingParams(temperature=0, top_p=0.5, top_k=10, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    q = SamplingParams(temperature=np.float32(0.5), n=np.int64(2))
    assert type(q.temperature) is float and type(q.n) is int
    # A non-greedy request keeps its truncation settings.
    r = SamplingParams(temperature=0.5, top_p=0.5, top_k=10, min_p=0.3)
    assert (r.top_p, r.top_k, r.min_p) == (0.5, 10, 0.3)


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(use_beam_search=True, n=2, temperature=0).sampling_type is SamplingType.BEAM


def test_clone_is_equal_and_independent():
    p = SamplingParams(n=2, temperature=0.5, stop=["a"], stop_token_ids=[1], seed=9)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


def test_repr_is_readable():
    r = repr(SamplingParams(n=2, temperature=0.5, stop="x"))
    assert r.startswith("SamplingParams(")
    for frag in ("n=2", "best_of=2", "temperature=0.5", "stop=['x']", "top_k=-1", "max_tokens=16"):
        assert frag in r, r


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 40), st.integers(), st.text(max_size=3),
    st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(-2, 5), max_size=3),
    st.sampled_from(["never", "", "\n", 0.0, 1.0, 1e-6, 2.0]),
)
_FIELDS = ["n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
           "top_p", "top_k", "min_p", "seed", "use_beam_search", "length_penalty", "early_stopping",
           "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=5))
def test_only_value_errors_and_accepted_values_are_sane(kwargs):
    """Any input either builds a consistent object or raises ValueError, never
    another exception type."""
    try:
        p = SamplingParams(**kwargs)
    except ValueError:
        return
    assert type(p.n) is int and type(p.best_of) is int and p.best_of >= p.n >= 1
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "length_penalty"):
        v = getattr(p, name)
        assert type(v) is float and math.isfinite(v)
    assert p.temperature >= 0 and 0 < p.top_p <= 1 and 0 <= p.min_p <= 1
    assert p.top_k == -1 or p.top_k >= 1
    assert p.max_tokens is None or p.max_tokens >= max(1, p.min_tokens)
    if p.sampling_type is SamplingType.GREEDY:
        assert p.best_of == 1 and (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    if not p.use_beam_search:
        assert p.early_stopping is False and p.length_penalty == 1.0
    # Re-validating an accepted object's fields accepts them again.
    import dataclasses

    assert SamplingParams(**dataclasses.asdict(p)) == p
