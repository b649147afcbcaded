"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around one ``LLMEngine``.

    paged-jax serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream=true`` for server-sent events), ``GET /health``, ``GET /metrics`` (Prometheus).
Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import copy
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
from paged_jax.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from paged_jax.server.serving import OpenAIServing

logger = logging.getLogger("paged_jax.server")


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
                err = APIError(msg, 401, code="invalid_api_key")
                await JSONResponse(err.body(), 401)(scope, receive, send)
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
              chat_template: Optional[str] = None) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan."""
    metrics = ServerMetrics()
    async_engine = AsyncLLMEngine(engine, metrics)
    metrics.stats_source = lambda: async_engine.stats
    serving = OpenAIServing(async_engine, copy.deepcopy(engine.tokenizer), served_model_name,
                            engine.scheduler_config.max_model_len, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="paged-jax", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.serving = serving
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(str(exc.detail), exc.status_code)
        return JSONResponse(err.body(), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error")
        err = APIError(f"internal error: {type(exc).__name__}: {exc}", 500)
        return JSONResponse(err.body(), 500)

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            raise APIError(f"the engine is not running ({async_engine.error!r})", 503)
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
        return await serving.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    return app


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
               served_model_name: Optional[str] = None, chat_template: Optional[str] = None,
               log_level: str = "info", access_log: bool = True) -> None:
    import uvicorn

    name = served_model_name or str(engine.args.model or "paged-jax-tiny")
    app = build_app(engine, name, api_key, chat_template)
    logger.warning("serving %r on http://%s:%d (OpenAI API under /v1)", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
