"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around one ``LLMEngine``.

    paged-jax serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream=true`` for server-sent events), ``GET /health``, ``GET /metrics`` (Prometheus).
Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Reliability: a request body over ``max_request_body_bytes`` gets 413 before it is read into
memory; input the client controls never gives a 500 (a lone surrogate is a 400 naming the field,
and a 500's internal text is logged, not sent); if the engine's device step fails the engine
stops, ``/health`` answers 503, ``/metrics`` shows ``paged_jax_engine_healthy 0`` and
``run_server`` returns 1 so the process exits non-zero for a supervisor to restart it.
"""

from __future__ import annotations

import copy
import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_jax.server.async_engine import AsyncLLMEngine
from paged_jax.server.metrics import ServerMetrics
from paged_jax.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, reject_surrogates
from paged_jax.server.serving import OpenAIServing

logger = logging.getLogger("paged_jax.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt the context window can hold


def error_response(err: APIError, headers=None) -> Response:
    """OpenAI's error shape as ASCII JSON (non-ASCII escaped), so that a message quoting client
    text, even a lone surrogate, always encodes."""
    return Response(json.dumps(err.body()), err.status, headers=headers, media_type="application/json")


class BodyLimitMiddleware:
    """Plain ASGI middleware: a request body over ``max_bytes`` gets 413 (OpenAI's error shape),
    judged from Content-Length when given and otherwise while it arrives, so that it is never
    read into memory whole."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: Optional[int] = None) -> Response:
        got = f" ({size} bytes)" if size is not None else ""
        return error_response(APIError(f"The request body is too large{got}: this server accepts at most "
                                       f"{self.max_bytes} bytes (--max-request-body-bytes).", 413,
                                       code="request_too_large"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(int(length))(scope, receive, send)
            return
        # Without a (truthful) Content-Length, read the body here up to the limit, then replay it.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: disconnect notifications

        await self.app(scope, replay, send)


class APIKeyMiddleware:
    """Plain ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer KEY`` (checked before the body is read)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization")
            if auth is None or not secrets.compare_digest(auth, self.expected):
                msg = ("Missing API key: send it as 'Authorization: Bearer <key>'." if auth is None
                       else "Incorrect API key provided.")
                await error_response(APIError(msg, 401, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400, naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(f"Malformed JSON in the request body: {detail}".rstrip(": "), 400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and isinstance(first.get("input"), (bytes, str)):
        return APIError("The request body was not read as JSON: send it with 'Content-Type: application/json'.", 400)
    if not loc:
        return APIError(f"The request body must be a JSON object, got {first.get('input')!r:.200}", 400)
    field = loc[0]
    # A union (e.g. prompt: str | list[int] | ...) reports one error per member: say them once, briefly.
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [field]]
    msgs = list(dict.fromkeys(e["msg"] for e in same))[:4]
    path = field if len(same) > 1 else field + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])
    got = first.get("input")
    got_txt = "" if first.get("type") == "missing" else f", got {got!r:.200}"
    return APIError(f"Invalid value for '{path}': {'; or '.join(msgs)}{got_txt}", 400, param=field)


def build_app(engine, served_model_name: str, api_key: Optional[str] = None,
              chat_template: Optional[str] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan."""
    if not isinstance(max_request_body_bytes, int) or max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be an int >= 1, got {max_request_body_bytes!r}")
    metrics = ServerMetrics()
    async_engine = AsyncLLMEngine(engine, metrics)
    metrics.stats_source = lambda: {**async_engine.stats, "engine_healthy": int(async_engine.is_running)}
    serving = OpenAIServing(async_engine, copy.deepcopy(engine.tokenizer), served_model_name,
                            engine.scheduler_config.max_model_len, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            serving.close()

    app = FastAPI(title="paged-jax", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.serving = serving
    # Added last, so it runs first: the key is checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(str(exc.detail), exc.status_code), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # The exception text may quote internals (paths, code): it goes to the log, not to the client.
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError("The server had an error while processing your request; it is in "
                                       "the server log.", 500))

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            why = " (it stopped after an internal error; see the server log)" if async_engine.error else ""
            raise APIError(f"the engine is not running{why}", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse({"object": "list", "data": [serving.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        serving.check_model(model)
        return JSONResponse(serving.model_card())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        reject_surrogates(body)
        return await serving.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        reject_surrogates(body)
        return await serving.chat(body, raw)

    return app


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
               served_model_name: Optional[str] = None, chat_template: Optional[str] = None,
               log_level: str = "info", access_log: bool = True,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> int:
    """Serve until stopped; returns the process exit status: 0 after a normal shutdown, 1 when the
    engine died (a failed device step), so that a supervisor restarts the server."""
    import uvicorn

    name = served_model_name or str(engine.args.model or "paged-jax-tiny")
    app = build_app(engine, name, api_key, chat_template, max_request_body_bytes)
    # Keep-alive connections idle past 5 s are closed; a request head over 64 KiB is refused.
    # uvicorn has no timeout for a head that never finishes: put a proxy in front for that.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=5, timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 << 10)
    server = uvicorn.Server(config)
    async_engine = app.state.async_engine

    def engine_died(exc: BaseException) -> None:
        logger.critical("the engine stopped (%s: %s): shutting the server down", type(exc).__name__, exc)
        server.should_exit = True

    async_engine.on_fatal = engine_died
    logger.warning("serving %r on http://%s:%d (OpenAI API under /v1)", name, host, port)
    server.run()
    return 1 if async_engine.error is not None else 0
