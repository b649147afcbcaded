"""The server in process (FastAPI's TestClient): input the client controls gets a 4xx in OpenAI's error
shape, never a 500 or a dead engine; bodies are size-limited; tokenization does not block the event loop;
after a failed device step /health and /metrics say so and ``run_server`` exits non-zero."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from paged_jax import LLM
from paged_jax.server.api_server import build_app


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256).llm_engine


@pytest.fixture()
def client(engine):
    app = build_app(engine, "tiny", chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                    max_request_body_bytes=64 << 10)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.app_ref = app
        yield c
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _error(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _post(client, path: str, body: dict):
    """POST ``body`` as ASCII JSON (``\\ud800`` escapes, as a client would send a lone surrogate)."""
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _ok(client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"model": "ti\udfffny", "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": ["ok", "x\ud800"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\udc80"}]}, "messages"),
])
def test_lone_surrogates_are_400_not_500(client, path, body, param):
    err = _error(_post(client, path, body), 400, param)
    assert "surrogate" in err["message"]
    _ok(client)


def test_one_request_cannot_stop_the_engine(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stop_token_ids": [2147483648],
                                             "min_tokens": 1})
    assert "vocabulary" in _error(r, 400, "stop_token_ids")["message"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "use_beam_search": True, "n": 2,
                                             "temperature": 0, "length_penalty": 2000, "max_tokens": 6})
    assert r.status_code == 200, r.text
    _ok(client)


def test_internal_errors_are_logged_not_sent(client, monkeypatch, caplog):
    serving = client.app_ref.state.serving

    async def broken(req, raw):
        raise RuntimeError("secret internal detail /srv/paged_jax")

    monkeypatch.setattr(serving, "completion", broken)
    err = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}), 500)
    assert "secret" not in err["message"]
    assert "secret internal detail" in caplog.text


def test_body_size_limit(client):
    big = {"model": "tiny", "prompt": "x" * (65 << 10)}
    err = _error(client.post("/v1/completions", json=big), 413)
    assert str(64 << 10) in err["message"]

    def chunks():  # no Content-Length: the limit applies while the body arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    _error(client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    _ok(client)


def test_tokenization_does_not_block_the_event_loop(client, monkeypatch):
    serving = client.app_ref.state.serving
    entered, release = threading.Event(), threading.Event()
    real = serving.prompts.tokenizer.encode

    def slow_encode(text, *a, **kw):
        if text == "slow prompt":
            entered.set()
            release.wait(10)
        return real(text, *a, **kw)

    monkeypatch.setattr(serving.prompts.tokenizer, "encode", slow_encode)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "slow prompt", "max_tokens": 2})))
    t.start()
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t0 < 5 and not release.is_set()  # answered while the prompt was tokenizing
    finally:
        release.set()
        t.join(30)
    assert done["r"].status_code == 200


def test_batched_completion_stops_queueing_when_the_client_leaves(engine):
    import asyncio
    import copy

    from paged_jax.server.async_engine import AsyncLLMEngine
    from paged_jax.server.protocol import CompletionRequest
    from paged_jax.server.serving import OpenAIServing

    async_engine = AsyncLLMEngine(engine)
    serving = OpenAIServing(async_engine, copy.deepcopy(engine.tokenizer), "tiny", 256, disconnect_poll_s=0.01)
    added = []
    real_add = async_engine.add_request

    async def add_request(rid, *a, **kw):
        added.append(rid)
        return await real_add(rid, *a, **kw)

    async_engine.add_request = add_request

    class GoneClient:  # the part of Starlette's Request the handler polls
        async def is_disconnected(self):
            return True

    async def main():
        async_engine.start()
        try:
            req = CompletionRequest(model="tiny", prompt=[f"prompt {i}" for i in range(8)], max_tokens=50,
                                    ignore_eos=True)
            return await serving.completion(req, GoneClient())
        finally:
            for _ in range(200):  # the aborts are processed on the engine's next iteration
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            async_engine.shutdown()

    r = asyncio.run(asyncio.wait_for(main(), 60))
    assert r.status_code == 400 and b"disconnected" in r.body
    assert len(added) < 8
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_engine_death_health_metrics_and_exit_status(tiny_llama_dir, monkeypatch):
    """A failed device step: the request gets 503, /health 503, /metrics engine_healthy 0, and
    run_server returns 1 (the process exits non-zero for a supervisor)."""
    import socket

    import httpx

    from paged_jax.server import api_server

    checked = threading.Event()

    class HoldsTheServerUp(api_server.AsyncLLMEngine):
        """The server's on_fatal hook shuts it down at once, before a client could ask /health or
        /metrics; here it runs only once the client has asked them (or after 30 s)."""

        @property
        def on_fatal(self):
            return self._on_fatal

        @on_fatal.setter
        def on_fatal(self, hook):
            self._on_fatal = None if hook is None else (lambda exc: (checked.wait(30), hook(exc)))

    monkeypatch.setattr(api_server, "AsyncLLMEngine", HoldsTheServerUp)
    engine = LLM(model=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=128).llm_engine

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, seen = f"http://127.0.0.1:{port}", {}

    def client():
        try:
            for _ in range(300):
                try:
                    seen["health_before"] = httpx.get(url + "/health", timeout=1)
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            seen["completion"] = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                                            timeout=30)
            seen["health"] = httpx.get(url + "/health", timeout=5)
            seen["metrics"] = httpx.get(url + "/metrics", timeout=5)
        finally:
            checked.set()

    t = threading.Thread(target=client)
    t.start()
    status = api_server.run_server(engine, port=port, served_model_name="tiny", log_level="warning",
                                   access_log=False)
    t.join(30)
    assert status == 1
    assert seen["health_before"].status_code == 200
    err = _error(seen["completion"], 503)
    assert "device lost" not in err["message"]
    _error(seen["health"], 503)
    assert seen["metrics"].status_code == 200
    assert "paged_jax_engine_healthy 0.0" in seen["metrics"].text.splitlines()


def test_metrics_say_the_engine_is_healthy(client):
    assert "paged_jax_engine_healthy 1.0" in client.get("/metrics").text


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_fails_inside_the_engine_fails_alone(client, engine, monkeypatch, stream):
    """Fault injection behind the server: that request gets a 500 (an error event when streaming) that
    names no internals; the engine goes on serving the others."""
    real = engine._detokenize

    def detokenize(seq, params):
        if params.max_tokens == 7:  # the doomed request
            raise RuntimeError("secret detail")
        return real(seq, params)

    monkeypatch.setattr(engine, "_detokenize", detokenize)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 7, "stream": stream})
    if stream:
        assert r.status_code == 500 or ('"error"' in r.text and r.text.rstrip().endswith("[DONE]")), r.text
    else:
        _error(r, 500)
    assert "secret" not in r.text
    _ok(client)
