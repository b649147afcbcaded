"""Property-based fuzzing (hypothesis) of what a client controls.

``SamplingParams`` with any field values either validates or raises ``ValueError`` (never another
exception). Request bodies drawn from valid and hostile values, sent to the server in process, get
200 or a 4xx in OpenAI's error shape, never a 5xx; bodies valid by construction get 200 and their
text (or a complete event stream without an error); the engine keeps serving; every KV block is
free at the end. The default run is bounded (tens of examples); ``-m slow`` runs a longer one.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paged_jax import LLM, SamplingParams
from paged_jax.server.api_server import build_app

HOSTILE_STRINGS = ["a\ud800b", "\udfff", "\x00", "\u202e", "\U0001F600" * 3, "never", ""]

small_ints = st.integers(-2, 6)
ints = st.one_of(small_ints, st.sampled_from([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 63, -2 ** 63, 10 ** 30]))
floats = st.one_of(st.floats(-3, 3, allow_nan=False), st.sampled_from([0.0, 1.0, 1e-6, 2000.0, -2000.0, 1e300]))
texts = st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_STRINGS))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)

# Well-formed values (in range, so that most requests run; some hostile but well-formed, such as a
# stop token id past the vocabulary or a huge length penalty) ...
VALID = {
    "n": st.sampled_from([1, 1, 1, 2, 3]), "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 600), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2), "seed": st.integers(-2 ** 70, 2 ** 70), "min_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 5), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, 600), st.sampled_from([512, 2 ** 31, 2 ** 63 + 1])),
                               max_size=3),
    "ignore_eos": st.booleans(), "use_beam_search": st.booleans(),
    "length_penalty": st.one_of(st.floats(-3000, 3000), st.sampled_from([1.0, 2000.0, -2000.0])),
    "early_stopping": st.one_of(st.booleans(), st.just("never")), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "echo": st.booleans(), "stream": st.booleans(),
}
# ... and hostile ones: any JSON scalar, out-of-range numbers, lone surrogates.
HOSTILE = {k: st.one_of(v, scalars, st.lists(scalars, max_size=2))
           for k, v in {**VALID, "best_of": st.integers(1, 4)}.items()}


@st.composite
def valid_fields(draw) -> dict:
    """A few well-formed fields (many at once mostly conflict, e.g. beam search with temperature > 0)."""
    if draw(st.integers(0, 3)) == 0:  # beam search, with the fields that mean something there
        keys = draw(st.lists(st.sampled_from(BEAM_FIELDS), max_size=4, unique=True))
        return {"use_beam_search": True, "temperature": 0, "n": draw(st.integers(2, 3)),
                **{k: draw(VALID[k]) for k in keys}}
    keys = draw(st.lists(st.sampled_from(sorted(VALID)), max_size=4, unique=True))
    return {k: draw(VALID[k]) for k in keys}


BEAM_FIELDS = ["length_penalty", "early_stopping", "max_tokens", "stop_token_ids", "min_tokens", "logprobs",
               "ignore_eos"]


# Bodies valid by construction: every one must run (200). The fields conflict with nothing drawn beside
# them, token ids are in the vocabulary (512), and a prompt of 8 characters (up to 4 byte tokens each),
# its BOS and 8 new tokens fit max_model_len (48).
RUNNABLE_SAMPLING = {
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 600), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2), "seed": st.integers(-2 ** 70, 2 ** 70), "logprobs": st.integers(0, 5),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(), "echo": st.booleans(),
    "stream": st.booleans(),
}
RUNNABLE_BEAM = {
    "length_penalty": st.floats(-3000, 3000), "early_stopping": st.one_of(st.booleans(), st.just("never")),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
}


@st.composite
def runnable_fields(draw) -> dict:
    max_tokens = draw(st.integers(1, 8))
    if draw(st.integers(0, 3)) == 0:  # beam search: greedy, n > 1, not streamed
        fields = draw(st.fixed_dictionaries({}, optional=RUNNABLE_BEAM))
        return {"use_beam_search": True, "temperature": 0, "n": draw(st.integers(2, 3)), "max_tokens": max_tokens,
                "min_tokens": draw(st.integers(0, max_tokens)), **fields}
    n = draw(st.integers(1, 3))
    # n > 1 samples: greedy would give n copies and is refused
    temperature = draw(st.floats(0.05, 2) if n > 1 else st.one_of(st.just(0.0), st.floats(0, 2)))
    fields = draw(st.fixed_dictionaries({}, optional=RUNNABLE_SAMPLING))
    return {"n": n, "temperature": temperature, "max_tokens": max_tokens,
            "min_tokens": draw(st.integers(0, max_tokens)), **fields}


runnable_prompts = st.one_of(st.text(min_size=1, max_size=8), st.lists(st.integers(0, 511), min_size=1, max_size=6),
                             st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3))
runnable_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                    "content": st.text(max_size=4)}), min_size=1, max_size=2)


hostile_fields = st.fixed_dictionaries({}, optional=HOSTILE)
valid_prompts = st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 511), min_size=1, max_size=6),
                          st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3))
hostile_prompts = st.one_of(texts, st.lists(ints, max_size=6), scalars)


def _mostly(draw, valid, hostile):
    """A valid value 7 times in 8 (most requests should run), else a hostile one."""
    return draw(hostile) if draw(st.integers(0, 7)) == 0 else draw(valid)


@st.composite
def completion_bodies(draw) -> tuple[dict, bool]:
    """(body, whether it must run): a runnable body a quarter of the time (each runs the engine for up
    to 8 steps), else one that may be refused."""
    if draw(st.integers(0, 3)) == 0:
        return {"model": "tiny", "prompt": draw(runnable_prompts), **draw(runnable_fields())}, True
    body = {"model": _mostly(draw, st.just("tiny"), texts), "prompt": _mostly(draw, valid_prompts, hostile_prompts)}
    body.update(_mostly(draw, valid_fields(), hostile_fields))
    return body, False


@st.composite
def chat_bodies(draw) -> tuple[dict, bool]:
    """(body, whether it must run), as completion_bodies."""
    runnable = draw(st.integers(0, 3)) == 0
    if runnable:
        body = {"model": "tiny", "messages": draw(runnable_messages), **draw(runnable_fields())}
    else:
        content = st.one_of(st.text(min_size=1, max_size=20), texts)
        messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                   "content": content}), min_size=1, max_size=3)
        body = {"model": "tiny", "messages": _mostly(draw, messages, scalars)}
        body.update(_mostly(draw, valid_fields(), hostile_fields))
    body.pop("echo", None)
    if isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool):
        body["top_logprobs"], body["logprobs"] = body["logprobs"], True  # chat's shape of the same field
    return body, runnable


SAMPLING_KW = {k: v for k, v in HOSTILE.items() if k not in ("echo", "stream")}


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional=SAMPLING_KW))
def test_sampling_params_validate_or_raise_value_error(kw):
    try:
        p = SamplingParams(**kw)
    except ValueError as exc:
        assert str(exc)
        return
    assert p.n >= 1 and p.best_of >= p.n and (p.max_tokens is None or p.max_tokens >= 1)


@pytest.fixture(scope="module")
def app_client(tiny_llama_dir):
    engine = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=48, max_num_seqs=8).llm_engine
    app = build_app(engine, "tiny", chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.block_manager.check_invariants()


def _send(client, path: str, body: dict, runnable: bool) -> None:
    r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    if runnable:
        assert r.status_code == 200, (body, r.status_code, r.text)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        if runnable:  # a stream's status is sent before the engine runs: a failure shows as an error event
            events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert events and not any("error" in e for e in events), (body, r.text[-600:])
    else:
        choices = r.json()["choices"]
        assert choices, (body, r.text)
        if path == "/v1/chat/completions":
            assert all(isinstance(c["message"]["content"], str) for c in choices), (body, r.text)
        else:
            assert all(isinstance(c["text"], str) for c in choices), (body, r.text)
        if runnable:  # one choice per sample of each prompt
            prompt = body.get("prompt")
            n_prompts = len(prompt) if path == "/v1/completions" and isinstance(prompt, list) and \
                all(isinstance(p, str) for p in prompt) else 1
            assert len(choices) == body.get("n", 1) * n_prompts, (body, r.text)
    assert client.get("/health").status_code == 200


def _check_serving(client, engine) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert not engine.has_unfinished_requests()


ALL_SAMPLING_FIELDS = {"n": 2, "temperature": 0.8, "max_tokens": 4, "min_tokens": 1, "top_p": 0.9, "top_k": 5,
                       "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                       "seed": 2 ** 70, "stop": ["\n\n"], "stop_token_ids": [7], "ignore_eos": True,
                       "skip_special_tokens": False, "include_stop_str_in_output": True}


def _fuzz(app_client, max_examples: int) -> None:
    client, engine = app_client

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @example(("/v1/completions", ({"model": "tiny", "prompt": "hi", "stop_token_ids": [2 ** 31], "min_tokens": 1},
                                  False)))
    @example(("/v1/completions", ({"model": "tiny", "prompt": "hi", "use_beam_search": True, "n": 2,
                                   "temperature": 0, "length_penalty": 2000}, True)))
    @example(("/v1/completions", ({"model": "ti\udfffny", "prompt": "a\ud800b"}, False)))
    # Every runnable sampling field at once, so that each is seen on every run (drawn ones may miss one).
    @example(("/v1/completions", ({"model": "tiny", "prompt": ["def f(", "x = "], "echo": True, "logprobs": 2,
                                   **ALL_SAMPLING_FIELDS}, True)))
    @example(("/v1/chat/completions", ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                        "stream": True, "logprobs": True, "top_logprobs": 2,
                                        **ALL_SAMPLING_FIELDS}, True)))
    @given(st.one_of(completion_bodies().map(lambda b: ("/v1/completions", b)),
                     chat_bodies().map(lambda b: ("/v1/chat/completions", b))))
    def run(case):
        path, (body, runnable) = case
        _send(client, path, body, runnable)

    run()
    _check_serving(client, engine)


def test_fuzz_requests_never_5xx(app_client):
    # 40 drawn bodies beside the explicit examples (every sampling field, streaming, beam search, bad
    # unicode) keep the default run short; test_fuzz_requests_never_5xx_long (-m slow) draws 600.
    _fuzz(app_client, 40)


@pytest.mark.slow
def test_fuzz_requests_never_5xx_long(app_client):
    _fuzz(app_client, 600)
