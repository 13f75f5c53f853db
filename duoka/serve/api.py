"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions,
/v1/models, /health, /metrics: the routes, the middleware (key, body size) and the SSE
streams. The request schemas, the error object and their limits are serve/protocol.py.

As vLLM serves them (vllm/entrypoints/openai), so that the `openai` client and `vllm bench
serve` work unmodified:
- responses: chat.completion / text_completion objects with usage counted exactly
  (protocol.usage_body);
- streams: server-sent events `data: {json}\\n\\n`; chat's first chunk carries the role (sent
  with the first token, as vLLM does, so a client's time-to-first-token means the first
  token), the last content chunk carries finish_reason, then with
  stream_options.include_usage a chunk with `choices: []` and the usage, then `data: [DONE]`;
- errors (protocol.error_body): 400 for every malformed request (FastAPI's 422 is turned
  into 400), 401 for a missing or wrong key on /v1/*, 404 for an unknown route, 413 for a
  body over protocol.MAX_BODY_BYTES, 503 with Retry-After when the queue is full or the
  server is draining, 500 only when the engine itself failed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from duoka.errors import DuokaError
from duoka.serve.async_engine import AsyncEngine, EngineError, RequestStream, ServerBusy
from duoka.serve.params import RequestOutput, SamplingParams
from duoka.serve.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    chat_message_dict,
    error_body,
    error_response,
    finite,
    refuse_unsupported,
    usage_body,
    validation_message,
)
from duoka.serve.server_metrics import CONTENT_TYPE


# ---------------------------------------------------------------- errors
def _duoka_message(e: DuokaError) -> str:
    return e.cause if e.fix is None else f"{e.cause}; fix: {e.fix}"


def _busy_code(e: ServerBusy) -> str:
    return {"QueueFull": "queue_full", "Draining": "server_shutting_down", "EngineDead": "engine_dead"}.get(
        type(e).__name__, "unavailable")


def _busy_error(e: ServerBusy) -> ApiError:
    return ApiError(503, str(e), code=_busy_code(e), headers={"Retry-After": str(e.retry_after_s)})


# ---------------------------------------------------------------- the app
@dataclass
class _Prepared:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class _BearerAuth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <key>` (checked before the body is
    read, so a caller without the key learns nothing about the request's validity). /health
    and /metrics stay open for probes and scrapers, as vLLM's --api-key does."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            # The scheme's case does not matter (RFC 9110, 11.1: `bearer` is `Bearer`); the key's
            # does, compared in constant time: no key recovery by timing.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.expected):
                response = error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer "
                                               "<key>' with the key the server was started with (--api-key)",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: bodies over `limit` bytes get a 413, from their Content-Length when
    they declare one, else as soon as the bytes read pass it. The body is read here and handed
    on whole (the app would read it whole anyway); later messages (a disconnect) pass through."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        if size >= FAST_JSON_BYTES:
            await asyncio.sleep(0)  # the copy and the parse to come hold the loop: other requests go between

        async def replay():
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, f"the request body is larger than {self.limit // 2**20} MiB",
                                  code="request_too_large")
        await response(scope, receive, send)


# From this size on a JSON body is parsed by pydantic-core's parser: ~3.5x faster than json's
# (6 ms against 22 ms for 15 MB), and the parse holds the event loop for all of its time.
FAST_JSON_BYTES = 1 << 20


class _FastJSONRequest(Request):
    """The request as FastAPI reads it, with less work on the event loop for a large body: the
    body taken as the one message _BodyLimit hands on (Starlette's body() would copy it again:
    12 ms for 15 MB), and JSON parsed by pydantic-core's parser."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            chunks = [chunk async for chunk in self.stream() if chunk]
            self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body) if len(body) >= FAST_JSON_BYTES else json.loads(body)
            except ValueError:  # json's own error, for the message and position FastAPI reports
                self._json = json.loads(body)
        return self._json


class _Route(APIRoute):
    """FastAPI's route, reading JSON bodies through _FastJSONRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_FastJSONRequest(request.scope, request.receive))

        return route


def build_app(async_engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
              default_params: dict[str, Any], api_key: str | None = None) -> FastAPI:
    """default_params: SamplingParams fields from the model's generation_config.json; a
    request's own fields override them."""
    app = FastAPI(title="duoka serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = _Route
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    if api_key:  # added last, so it runs first: a caller without the key is refused unread
        app.add_middleware(_BearerAuth, api_key=api_key)
    started = int(time.time())
    server = _Server(async_engine, tokenizer, model_name, max_model_len, dict(default_params))

    # ---- errors in OpenAI's format
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
        print(f"duoka serve: internal error on {request.method} {request.url.path}:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return error_response(500, f"internal server error ({type(exc).__name__}); the server's log has the traceback")

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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "duoka", "root": model_name, "parent": None,
                                            "max_model_len": max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        prepared = await server.prepare_chat(body)
        return await server.respond(request, prepared, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prepared = await server.prepare_completion(body)
        return await server.respond(request, prepared, body, chat=False)

    return app


class _Server:
    def __init__(self, async_engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
                 default_params: dict[str, Any]):
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_params = default_params
        self.token_text = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))

    # ---- request -> (prompt ids, SamplingParams)
    def _check_model(self, body: CommonRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models lists it)", param="model", code="model_not_found")

    async def prepare_chat(self, body: ChatRequest) -> _Prepared:
        self._check_model(body)
        refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [chat_message_dict(i, m) for i, m in enumerate(body.messages)]
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                           tokenize=False)
        except DuokaError as e:
            raise ApiError(400, _duoka_message(e), param="messages") from None
        prompt_ids = await self._encode(text, "messages", add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._prepare("chatcmpl", list(prompt_ids), body, max_tokens, logprobs, "messages")

    async def prepare_completion(self, body: CompletionRequest) -> _Prepared:
        self._check_model(body)
        refuse_unsupported(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt is a batch of {len(prompt)} prompts; batched prompts are not supported "
                                    "yet: send one request per prompt", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await self._encode(prompt, "prompt")
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if t < 0]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is negative", param="prompt")
        return self._prepare("cmpl", list(prompt_ids), body, body.max_tokens, body.logprobs, "prompt")

    async def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids, tokenized on a worker thread (tokenizers releases the GIL for long
        text: the event loop keeps serving), and refused from a prefix when it is far too long."""
        limit = self.max_model_len - 1
        ids = await asyncio.to_thread(self.tokenizer.encode_at_most, text, limit, add_special_tokens)
        if ids is None:
            raise ApiError(400, f"the prompt ({len(text):,} characters) holds more than {limit} tokens, the most this "
                                f"model's maximum context of {self.max_model_len} tokens leaves room for; fix: shorten "
                                "the prompt", param=param, code="context_length_exceeded")
        return ids

    def _prepare(self, prefix: str, prompt_ids: list[int], body: CommonRequest, max_tokens: int | None,
                 logprobs: int | None, prompt_param: str) -> _Prepared:
        n, limit = len(prompt_ids), self.max_model_len
        if n == 0:
            raise ApiError(400, "the prompt is empty (0 tokens); give at least one token", param=prompt_param)
        if n >= limit:
            raise ApiError(400, f"the prompt has {n} tokens, but this model's maximum context length is {limit} "
                                "tokens, which leaves no room for output; fix: shorten the prompt to at most "
                                f"{limit - 1} tokens", param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the request asks for "
                                f"{n + max_tokens}: {n} in the prompt and {max_tokens} in max_tokens; fix: lower "
                                f"max_tokens to {limit - n} or less, or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")
        if max_tokens is None:  # OpenAI: as long as the context allows; a model default may say less
            max_tokens = min(limit - n, self.default_params.get("max_tokens", limit))
        fields = {**self.default_params, "max_tokens": max_tokens, "ignore_eos": body.ignore_eos, "logprobs": logprobs}
        for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(body, name)
            if value is not None:
                fields[name] = value
        if body.stop is not None:
            fields["stop"] = body.stop
        if body.stop_token_ids is not None:
            fields["stop_token_ids"] = body.stop_token_ids
        try:
            params = SamplingParams(**fields)
        except DuokaError as e:
            raise ApiError(400, _duoka_message(e)) from None
        return _Prepared(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params)

    # ---- running it
    async def respond(self, request: Request, prepared: _Prepared, body: CommonRequest, chat: bool):
        try:
            stream = await self.engine.generate(prepared.request_id, prepared.prompt_ids, prepared.params)
        except DuokaError as e:
            raise ApiError(400, _duoka_message(e)) from None
        except ServerBusy as e:
            raise _busy_error(e) from None
        created = int(time.time())
        want_logprobs = prepared.params.logprobs is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = (self._chat_events if chat else self._completion_events)(
                stream, prepared.request_id, created, include_usage, want_logprobs)
            # The background abort covers a client that left before the first event: Starlette
            # then never starts the generator, so its own `finally` would not run.
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(stream.abort),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collected = await _unless_disconnected(request, _collect(stream))
        if collected is None:  # the client went away; its request was aborted, nobody reads this
            return Response(status_code=499)
        if isinstance(collected, Exception):
            return _failure_response(collected)
        text, outputs = collected
        last = outputs[-1]
        logprobs = [lp for out in outputs for lp in (out.new_logprobs or [])]
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = {"content": self._chat_logprobs(logprobs)} if want_logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(logprobs, 0) if want_logprobs else None
        choice["finish_reason"] = last.finish_reason
        return {"id": prepared.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.model_name, "choices": [choice], "usage": usage_body(last)}

    # Every output that carries tokens is an event, its text possibly empty (a token whose text
    # is held back, e.g. part of a UTF-8 character), as vLLM does: a client's time to first
    # token and inter-token latency then count tokens, not the tokens that happened to print.
    # Both SSE generators write every event that has arrived for their request at once (one
    # send, one socket write, when the event loop fell a few engine steps behind), and build
    # the common event (a text delta, no logprobs, not the last) from a template made once
    # per request, encoding only the text: the bytes are those _sse() would make of the
    # whole object (tests/unit/test_serve_api_unit.py compares them).
    def _chat_events(self, stream: RequestStream, request_id: str, created: int, include_usage: bool,
                     want_logprobs: bool) -> AsyncIterator[str | bytes]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        if include_usage:
            base["usage"] = None  # OpenAI: every chunk has usage null but the last one

        def chunk(delta: dict, logprobs=None, finish_reason=None) -> str:
            return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish_reason}]})

        template = None if want_logprobs else _template(
            {**base, "choices": [{"index": 0, "delta": {"content": _HOLE}, "logprobs": None, "finish_reason": None}]})

        def render(out: RequestOutput, first: bool) -> list[str]:
            events = [chunk({"role": "assistant", "content": ""})] if first else []
            if template is not None and out.new_token_ids and not out.finished:
                events.append(f"{template[0]}{_encode_str(out.new_text)}{template[1]}")
            elif out.new_token_ids or out.finished:
                logprobs = {"content": self._chat_logprobs(out.new_logprobs or [])} if want_logprobs else None
                events.append(chunk({"content": out.new_text} if out.new_text or not out.finished else {}, logprobs,
                                    out.finish_reason if out.finished else None))
            return events

        return self._events(stream, base, include_usage, render)

    def _completion_events(self, stream: RequestStream, request_id: str, created: int, include_usage: bool,
                           want_logprobs: bool) -> AsyncIterator[str | bytes]:
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        if include_usage:
            base["usage"] = None
        template = None if want_logprobs else _template(
            {**base, "choices": [{"index": 0, "text": _HOLE, "logprobs": None, "finish_reason": None}]})
        offset = 0  # characters streamed so far: the logprobs' text offsets

        def render(out: RequestOutput, first: bool) -> list[str]:
            nonlocal offset
            if template is not None and out.new_token_ids and not out.finished:
                return [f"{template[0]}{_encode_str(out.new_text)}{template[1]}"]
            if not (out.new_token_ids or out.finished):
                return []
            logprobs = self._completion_logprobs(out.new_logprobs or [], offset) if want_logprobs else None
            offset += len(out.new_text)
            return [_sse({**base, "choices": [{"index": 0, "text": out.new_text, "logprobs": logprobs,
                                               "finish_reason": out.finish_reason if out.finished else None}]})]

        return self._events(stream, base, include_usage, render)

    async def _events(self, stream: RequestStream, base: dict, include_usage: bool,
                      render: Callable[[RequestOutput, bool], list[str]]) -> AsyncIterator[str | bytes]:
        """One streamed request's SSE body: render(output, first) gives each output's events;
        then the usage event (when asked) and [DONE]. A failure mid-stream is an error event."""
        last = None
        try:
            while True:
                try:
                    outs = await stream.next_batch()
                except StopAsyncIteration:
                    break
                events = []
                for out in outs:
                    events += render(out, last is None)
                    last = out
                if events:
                    yield "".join(events).encode()
        except (EngineError, ServerBusy) as e:
            yield _sse(_failure_body(e))
            yield "data: [DONE]\n\n"
            return
        finally:
            stream.abort()  # a no-op once finished; a client that left gets its request aborted here
        if include_usage and last is not None:
            yield _sse({**base, "choices": [], "usage": usage_body(last)})
        yield "data: [DONE]\n\n"

    # ---- logprobs in OpenAI's two formats
    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _chat_logprobs(self, logprobs: list) -> list[dict]:
        return [{**self._entry(lp.token_id, lp.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs]

    def _completion_logprobs(self, logprobs: list, offset: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(finite(lp.logprob))
            top = {self.token_text(t): finite(v) for t, v in lp.top}
            top.setdefault(text, finite(lp.logprob))  # the sampled token is always listed, as vLLM does
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def _collect(stream: RequestStream) -> tuple[str, list[RequestOutput]] | Exception:
    parts, outputs = [], []
    try:
        async for out in stream:
            parts.append(out.new_text)
            outputs.append(out)
    except (EngineError, ServerBusy) as e:
        return e
    return "".join(parts), outputs


async def _unless_disconnected(request: Request, work):
    """Run `work`, unless the client disconnects first: then cancel it (its stream aborts the
    request in the engine) and return None. uvicorn does not cancel a handler whose client
    left, so a non-streamed request would otherwise run to the end for nobody."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def _failure_body(e: Exception) -> dict:
    if isinstance(e, ServerBusy):
        return error_body(503, str(e), code=_busy_code(e))
    return error_body(500, str(e), code="engine_error")


def _failure_response(e: Exception) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if isinstance(e, ServerBusy) else None
    return JSONResponse(_failure_body(e), status_code=503 if isinstance(e, ServerBusy) else 500, headers=headers)


# What json.dumps(obj, ensure_ascii=False, separators=(",", ":")) builds per call, built once
# (the encoder keeps no state between calls), and the string encoder it applies to every str.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_encode_str = json.encoder.encode_basestring
# A stand-in for the text in an event template: private-use characters, which no request id
# or model name of ours contains (a template is refused, not misbuilt, if one does).
_HOLE = "\ue000duoka-text\ue001"


def _sse(obj: dict) -> str:
    return f"data: {_ENCODER.encode(obj)}\n\n"


def _template(obj: dict) -> tuple[str, str] | None:
    """_sse(obj) split around the one string value _HOLE: an event with text T is then
    before + _encode_str(T) + after, byte for byte what _sse() makes of obj holding T."""
    parts = _sse(obj).split(_encode_str(_HOLE))
    return (parts[0], parts[1]) if len(parts) == 2 else None
