"""Structured output through the server, with the official ``openai`` client: ``response_format``
on chat completions and vLLM's ``structured_outputs`` on both endpoints, streamed and not; bad
constraints get 400 naming what is wrong. Oracles: ``jsonschema``, ``re``, the engine offline."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from paged_jax.models.tiny import default_model_path
from tests.test_server import MODEL, Server, client
from tests.test_structured_output import CHOICE, PROMPT, REGEX, SCHEMA

MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(default_model_path(), tmp_path_factory.mktemp("so-server") / "server.log")
    yield srv
    srv.stop()


FMT = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}


def test_response_format_and_structured_outputs(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=FMT, temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # vLLM's extra field on completions.
    r = c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=20,
                             extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, r.choices[0].text), r.choices[0].text


@pytest.mark.slow
def test_streaming_n_and_json_object(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=FMT, temperature=0, max_tokens=80)
    # Streamed: the deltas put together are the same document.
    stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=FMT, temperature=0,
                                       max_tokens=80, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == r.choices[0].message.content
    # n > 1 sampled, json_object: each sample that finishes is a JSON object.
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, n=3,
                                  temperature=0.8, seed=5, max_tokens=60)
    finished = [choice for choice in r.choices if choice.finish_reason == "stop"]
    assert finished
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    stream = c.completions.create(model=MODEL, prompt=PROMPT, temperature=0.7, seed=1, max_tokens=10, stream=True,
                                  extra_body={"structured_outputs": {"choice": CHOICE}})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) in CHOICE


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "not both"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs", "uniqueItems"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown fields ['regexp']"),
    ({"structured_outputs": {"regex": "a+"}, "use_beam_search": True, "n": 2, "temperature": 0},
     "structured_outputs", "use_beam_search"),
])
def test_bad_constraints_get_400(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_openai_client_sees_the_refusal_and_the_server_goes_on(server):
    with pytest.raises(openai.BadRequestError, match="unclosed character class"):
        client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                          extra_body={"structured_outputs": {"regex": "[0-9"}})
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert server.metrics()["paged_jax_engine_healthy"] == 1
