"""The HTTP middleware of `duoka serve` (serve/api.py builds the app with it): request ids,
CORS, the API key, the body-size limit, and the fast JSON body reader.

The stack, outermost first, and why in that order:
1. RequestId: every response, whoever made it (a CORS preflight, a 401, a 413, a 500, a
   stream), carries `x-request-id`, and every log line written while serving the request can
   name it (request_id(), request_line()).
2. CORSMiddleware (only with --allowed-origins): a browser's preflight OPTIONS is answered here,
   before the key is checked (a preflight never carries it), and a 401, 413 or 500 made further
   in still gets the CORS headers, so the page can read the error.
3. Starlette's ServerErrorMiddleware: the 500 handler (build_app's `_internal`).
4. BearerAuth (only with --api-key): a caller without the key is refused before the body is read.
5. BodyLimit: 413 over protocol.MAX_BODY_BYTES.
FastAPI always puts ServerErrorMiddleware outermost of what add_middleware adds; ServeApp puts
1 and 2 outside it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from duoka.errors import DuokaError
from duoka.serve.protocol import error_response

REQUEST_ID_HEADER = "x-request-id"
# A client's id is taken as given when it is 1..128 printable ASCII characters (it is echoed in
# a header and written in log lines: no control characters, no unbounded length); else one is made.
_GIVEN_REQUEST_ID = re.compile(r"[\x20-\x7e]{1,128}")
_REQUEST_ID: ContextVar[str | None] = ContextVar("duoka_serve_request_id", default=None)

Log = Callable[[str], None]


# ---------------------------------------------------------------- request ids and log lines
def request_id() -> str | None:
    """The id of the request being served in this context (None outside a request)."""
    return _REQUEST_ID.get()


def request_line(message: str) -> str:
    """`duoka serve: [request ID] message` while serving a request, `duoka serve: message` outside one."""
    rid = _REQUEST_ID.get()
    return f"duoka serve: {message}" if rid is None else f"duoka serve: [request {rid}] {message}"


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def log_line(message: str, log: Log = log_stderr) -> None:
    """Write `message` as request_line() tags it (the request id, when serving one)."""
    log(request_line(message))


def _given_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1").strip()
            return text if _GIVEN_REQUEST_ID.fullmatch(text) else None
    return None


class RequestId:
    """ASGI middleware: the request's id (the client's `x-request-id` when sane, else a new
    uuid4 hex) is set in a contextvar for the request's whole life and echoed as `x-request-id`
    on its response. With log_requests, one line when the request ends: method, path, status,
    duration (at the last body message; a response cut short is said to be)."""

    def __init__(self, app, log_requests: bool = False, log: Log = log_stderr):
        self.app = app
        self.log_requests = log_requests
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _given_request_id(scope["headers"]) or uuid.uuid4().hex
        header = (REQUEST_ID_HEADER.encode(), rid.encode())
        start = time.perf_counter()
        status: int | None = None
        logged = False

        async def send_with_id(message):
            nonlocal status, logged
            if message["type"] == "http.response.start":
                status = message["status"]
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != header[0]]
                message = {**message, "headers": [*kept, header]}
            await send(message)
            if self.log_requests and message["type"] == "http.response.body" and not message.get("more_body"):
                logged = True
                self._log_end(scope, status, start, "")

        token = _REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log_requests and not logged:  # the client left mid-stream, or the app failed
                self._log_end(scope, status, start, " (cut short)")
            _REQUEST_ID.reset(token)

    def _log_end(self, scope, status: int | None, start: float, note: str) -> None:
        ms = (time.perf_counter() - start) * 1e3
        log_line(f"{scope['method']} {scope['path']} {status or 'no response'} {ms:.1f} ms{note}", self.log)


# ---------------------------------------------------------------- CORS
# Any request header may be sent: the official JS client adds its own (x-stainless-os,
# x-stainless-retry-count, ...) and a fixed list breaks it whenever it adds one; the origin
# list, not the headers, is what grants access.
CORS_METHODS = ("GET", "POST", "OPTIONS")
CORS_HEADERS = ("*",)
CORS_EXPOSE = (REQUEST_ID_HEADER,)
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:[0-9]{1,5})?")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_as_sent(origin: str) -> str | None:
    """`origin` as a browser writes it in its Origin header (lower case, no path, no default
    port), or None when it cannot be read as a URL at all."""
    try:
        url = urlsplit(origin.strip())
        port = url.port
    except ValueError:
        return None
    if not url.scheme or not url.hostname:
        return None
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    keep_port = port is not None and port != _DEFAULT_PORTS.get(url.scheme.lower())
    return f"{url.scheme.lower()}://{host}" + (f":{port}" if keep_port else "")


def check_origins(origins: Iterable[str]) -> tuple[str, ...]:
    """The CORS origins, each `*` or `scheme://host[:port]` exactly as a browser sends it in
    its Origin header (an origin written otherwise would never match)."""
    if isinstance(origins, str):  # would be read letter by letter
        raise TypeError(f"allowed_origins takes a sequence of origins, not the string {origins!r}")
    checked = []
    for origin in origins:
        if origin != "*" and (not _ORIGIN.fullmatch(origin) or _origin_as_sent(origin) != origin):
            suggestion = _origin_as_sent(origin)
            fix = (f"write it as a browser sends it: {suggestion}" if suggestion and _ORIGIN.fullmatch(suggestion)
                   else "give scheme://host[:port], e.g. https://app.example.com or http://localhost:3000, or *")
            raise DuokaError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path)", fix)
        checked.append(origin)
    return tuple(checked)


def parse_origins(text: str | None) -> tuple[str, ...]:
    """--allowed-origins' comma-separated list, checked (check_origins); None or empty: no CORS."""
    return check_origins(part.strip() for part in (text or "").split(",") if part.strip())


def outer_middleware(allowed_origins: Sequence[str] = (), log_requests: bool = False,
                     log: Log = log_stderr) -> list[Middleware]:
    """The middleware outside the 500 handler, outermost first (the module's docstring says why).
    CORS is Starlette's CORSMiddleware: maintained, and it answers preflights by the spec."""
    stack = [Middleware(RequestId, log_requests=log_requests, log=log)]
    if allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(check_origins(allowed_origins)),
                                allow_methods=list(CORS_METHODS), allow_headers=list(CORS_HEADERS),
                                expose_headers=list(CORS_EXPOSE)))
    return stack


class ServeApp(FastAPI):
    """FastAPI with `outer` middleware wrapped around the whole stack, Starlette's
    ServerErrorMiddleware (the 500 handler) included: so a 500 too carries x-request-id and
    the CORS headers, and the internal-error log is written inside the request's context."""

    def __init__(self, *, outer: Sequence[Middleware] = (), **kwargs):
        super().__init__(**kwargs)
        self.outer_middleware = list(outer)

    def build_middleware_stack(self):
        app = super().build_middleware_stack()
        for cls, args, kwargs in reversed(self.outer_middleware):
            app = cls(app, *args, **kwargs)
        return app


# ---------------------------------------------------------------- the key and the body
class BearerAuth:
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


class BodyLimit:
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


class FastJSONRequest(Request):
    """The request as FastAPI reads it, with less work on the event loop for a large body: the
    body taken as the one message BodyLimit hands on (Starlette's body() would copy it again:
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


class FastJSONRoute(APIRoute):
    """FastAPI's route, reading JSON bodies through FastJSONRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(FastJSONRequest(request.scope, request.receive))

        return route
