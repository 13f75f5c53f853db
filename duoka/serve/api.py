"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions,
/v1/models, /health, /metrics: the routes and the error handlers. The middleware (request
ids, CORS, key, body size) is serve/http_middleware.py; the request schemas, the error object
and their limits serve/protocol.py; turning a request into engine requests
serve/api_requests.py, and their outputs into responses and SSE streams serve/api_responses.py.

Errors (protocol.error_body): 400 for every malformed request (FastAPI's 422 is turned into
400), 401 for a missing or wrong key on /v1/*, 404 for an unknown route and for a model the
server does not serve (code model_not_found, as OpenAI answers), 413 for a body over
protocol.MAX_BODY_BYTES, 503 with Retry-After when the queue is full or the server is
draining, 500 only when the engine itself failed.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from duoka.data.chat_template import RenderStop, request_stop
from duoka.serve.api_requests import RequestPreparer, ServedModels
from duoka.serve.api_responses import Responder, unless_disconnected
from duoka.serve.async_engine import AsyncEngine
from duoka.serve.http_middleware import (
    BearerAuth,
    BodyLimit,
    FastJSONRoute,
    Log,
    ServeApp,
    log_line,
    log_stderr,
    outer_middleware,
)
from duoka.serve.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatRequest,
    CompletionRequest,
    error_response,
    validation_message,
)
from duoka.serve.server_metrics import CONTENT_TYPE


def build_app(async_engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
              default_params: dict[str, Any], api_key: str | None = None, *, adapters: tuple[tuple[str, str], ...] = (),
              allowed_origins: tuple[str, ...] = (), log_requests: bool = False, log: Log = log_stderr) -> FastAPI:
    """default_params: SamplingParams fields from the model's generation_config.json; a
    request's own fields override them. adapters: the --lora adapters as (name, folder), each
    a model a request may name. allowed_origins: CORS (none: no CORS headers at all);
    log_requests: one log line per request; log: where the request and internal-error lines go.
    The middleware's order is serve/http_middleware.py's."""
    app = ServeApp(title="duoka serve", docs_url=None, redoc_url=None, openapi_url=None,
                   outer=outer_middleware(allowed_origins, log_requests=log_requests, log=log))
    app.router.route_class = FastJSONRoute
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    if api_key:  # added last, so it runs first: a caller without the key is refused unread
        app.add_middleware(BearerAuth, api_key=api_key)
    started = int(time.time())
    preparer = RequestPreparer(tokenizer, ServedModels(model_name, tuple(name for name, _ in adapters)), max_model_len,
                               dict(default_params))
    responder = Responder(async_engine, tokenizer, model_name)

    _add_error_handlers(app, log)

    # ---- routes
    @app.get("/health")
    async def health():
        dead = async_engine.dead
        if dead is not None:
            return error_response(503, f"the engine is not usable ({dead})", code="engine_dead")
        if not async_engine.accepting:
            return error_response(503, "the server is shutting down", code="server_shutting_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    def model_cards() -> list[dict[str, Any]]:
        # As vLLM lists them: the base model, then each adapter with the base as its parent; with
        # vLLM's max_model_len and the model's vocab_size (token ids a prompt may hold: 0..vocab_size-1).
        card = {"object": "model", "created": started, "owned_by": "duoka", "max_model_len": max_model_len,
                "vocab_size": async_engine.engine.limits.vocab_size}
        data = [{"id": model_name, **card, "root": model_name, "parent": None}]
        return data + [{"id": name, **card, "root": folder, "parent": model_name} for name, folder in adapters]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # :path: a served name may hold slashes (Qwen/Qwen2.5-7B, a folder)
        card = next((c for c in model_cards() if c["id"] == model_id), None)
        if card is None:
            raise preparer.models.not_found(model_id)
        return card

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        prepared = await _prepare_unless_gone(request, preparer.prepare_chat(body))
        if prepared is None:  # the client left while its chat template rendered: nobody reads this
            return Response(status_code=499)
        return await responder.respond(request, prepared, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prepared = await preparer.prepare_completion(body)
        return await responder.respond(request, prepared, body, chat=False)

    return app


def _add_error_handlers(app: FastAPI, log: Log) -> None:
    """Every error in OpenAI's format (protocol.error_body), the internal ones logged with their trace."""
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, *validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; the API serves /v1/chat/completions, " \
                      "/v1/completions, /v1/models, /health and /metrics"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # a bug: the client gets a 500 object, the log the trace
        log_line(f"internal error on {request.method} {request.url.path}:\n{traceback.format_exc()}", log)
        return error_response(500, f"internal server error ({type(exc).__name__}); the server's log has the traceback")


async def _prepare_unless_gone(request: Request, prepare) -> Any:
    """The prepared request, or None when the client disconnects first. The chat template
    renders on a worker thread, which a cancelled await would leave rendering for nobody: the
    render reads this request's RenderStop (data.chat_template) and ends once it is set."""
    stop = RenderStop()
    token = request_stop.set(stop)
    try:
        task = asyncio.ensure_future(prepare)  # the task copies the context, `stop` with it
    finally:
        request_stop.reset(token)

    try:
        return await unless_disconnected(request, task)
    finally:
        stop.stop("the client disconnected")  # nothing to stop once the render has ended
