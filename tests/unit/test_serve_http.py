"""duoka serve's HTTP middleware (serve/http_middleware.py) in process against the fake engine
of test_serve_api_unit.py: x-request-id on every response and in the log lines, CORS
(--allowed-origins) around the key and the body limit, --log-requests, and the flags' way
from the command line to the server."""

from __future__ import annotations

import asyncio
import re

import pytest
from fastapi.testclient import TestClient
from test_serve_api_unit import MAX_MODEL_LEN, MODEL, FakeEngine, chat_body

from duoka.data.tokenizer import load_tokenizer
from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir
from duoka.serve.api import build_app
from duoka.serve.async_engine import AsyncEngine
from duoka.serve.http_middleware import check_origins, parse_origins, request_id, request_line
from duoka.serve.protocol import MAX_BODY_BYTES
from duoka.serve.server_metrics import ServeMetrics

ORIGIN = "https://app.example"
KEY = "sekrit"
MADE_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_dir())


class BrokenTemplate:
    """The tokenizer, with a chat template that fails with a bug (not a DuokaError): a 500."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args, **kwargs):
        raise RuntimeError("boom (a bug in the template)")


class Served:
    def __init__(self, tokenizer, **options):
        self.logs: list[str] = []
        self.engine = FakeEngine(tokenizer)
        self.async_engine = AsyncEngine(self.engine, 64, ServeMetrics(MODEL), log=self.logs.append)
        self.app = build_app(self.async_engine, tokenizer, MODEL, MAX_MODEL_LEN, self.engine.default_params,
                             log=self.logs.append, **options)
        self.client = TestClient(self.app, raise_server_exceptions=False)

    def close(self):
        self.client.close()
        self.async_engine.close()


@pytest.fixture
def served(tokenizer):
    made = []

    def make(tokenizer_=None, **options):
        s = Served(tokenizer_ or tokenizer, **options)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def preflight(client, origin=ORIGIN, path="/v1/chat/completions"):
    return client.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "authorization, content-type, "
                                                                           "x-stainless-os, x-request-id"})


def too_big() -> str:
    return '{"prompt": "%s"}' % ("x" * (MAX_BODY_BYTES + 1))


# ---------------------------------------------------------------- x-request-id
def test_the_request_id_is_echoed_or_made_on_every_response(served):
    s = served(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = s.client.post("/v1/chat/completions", json=chat_body(), headers={**auth, "x-request-id": "client-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    first = s.client.post("/v1/chat/completions", json=chat_body(), headers=auth).headers["x-request-id"]
    second = s.client.get("/health").headers["x-request-id"]
    assert MADE_ID.fullmatch(first) and MADE_ID.fullmatch(second) and first != second
    with s.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True),
                         headers={**auth, "x-request-id": "stream-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "stream-1"
        assert "[DONE]" in r.read().decode()
    refused = {
        401: s.client.post("/v1/chat/completions", json=chat_body(), headers={"x-request-id": "a"}),
        404: s.client.get("/v1/nothing", headers={**auth, "x-request-id": "b"}),
        400: s.client.post("/v1/chat/completions", content="{", headers={**auth, "x-request-id": "c"}),
        413: s.client.post("/v1/completions", content=too_big(), headers={**auth, "x-request-id": "d"}),
    }
    for status, r in refused.items():
        assert r.status_code == status and r.json()["error"], (status, r.text[:200])
    assert [r.headers["x-request-id"] for r in refused.values()] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("given", [b"x" * 129, b"caf\xc3\xa9", b"   "])
def test_an_unusable_request_id_is_replaced(served, given):
    s = served()
    r = s.client.get("/health", headers={"x-request-id": given})
    assert MADE_ID.fullmatch(r.headers["x-request-id"])
    assert s.client.get("/health", headers={"x-request-id": "x" * 128}).headers["x-request-id"] == "x" * 128


def test_an_internal_error_is_logged_with_its_request_id(served, tokenizer):
    s = served(BrokenTemplate(tokenizer), log_requests=True, allowed_origins=(ORIGIN,))
    r = s.client.post("/v1/chat/completions", json=chat_body(), headers={"x-request-id": "bug-7", "Origin": ORIGIN})
    assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"]
    # The 500 comes from the outermost error handler; the request id and CORS still wrap it.
    assert r.headers["x-request-id"] == "bug-7" and r.headers["access-control-allow-origin"] == ORIGIN
    (internal,) = [line for line in s.logs if "internal error" in line]
    assert internal.startswith("duoka serve: [request bug-7] internal error on POST /v1/chat/completions:")
    assert "boom (a bug in the template)" in internal
    assert re.fullmatch(r"duoka serve: \[request bug-7\] POST /v1/chat/completions 500 [0-9.]+ ms", s.logs[-1])


def test_log_requests_writes_one_line_per_request(served):
    s = served(log_requests=True)
    s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-request-id": "one"})
    with s.client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        streamed = r.headers["x-request-id"]
        r.read()
    s.client.get("/v1/nope", headers={"x-request-id": "three"})
    lines = [line for line in s.logs if " ms" in line]
    assert len(lines) == 3, s.logs
    patterns = [r"\[request one\] POST /v1/completions 200 ", rf"\[request {streamed}\] POST /v1/completions 200 ",
                r"\[request three\] GET /v1/nope 404 "]
    for line, pattern in zip(lines, patterns):
        assert re.fullmatch(rf"duoka serve: {pattern}[0-9.]+ ms", line), line
    quiet = served()
    quiet.client.get("/health")
    assert quiet.logs == []  # off by default


def test_request_id_and_log_lines_outside_a_request():
    assert request_id() is None
    assert request_line("ready") == "duoka serve: ready"


# ---------------------------------------------------------------- CORS
def test_a_preflight_is_answered_without_the_key(served):
    s = served(api_key=KEY, allowed_origins=(ORIGIN, "http://localhost:3000"))
    r = preflight(s.client)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST", "OPTIONS"}
    assert "x-stainless-os" in r.headers["access-control-allow-headers"]  # the JS client's own headers pass
    assert MADE_ID.fullmatch(r.headers["x-request-id"])
    # Errors made further in are readable by the page: CORS headers on the 401 and the 413.
    for r in (s.client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": ORIGIN}),
              s.client.post("/v1/completions", content=too_big(),
                            headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})):
        assert r.status_code in (401, 413)
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-expose-headers"] == "x-request-id" and r.headers["x-request-id"]
    ok = s.client.post("/v1/chat/completions", json=chat_body(),
                       headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_other_origins_get_no_cors_headers(served):
    s = served(api_key=KEY, allowed_origins=(ORIGIN,))
    r = preflight(s.client, origin="https://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = s.client.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_cors_headers_without_allowed_origins(served):
    s = served(api_key=KEY)
    r = preflight(s.client)
    assert r.status_code == 401  # no CORS layer: the preflight is just an OPTIONS without the key
    r = s.client.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert not [name for name in r.headers if name.startswith("access-control-")]


def test_any_origin(served):
    s = served(allowed_origins=("*",))
    assert preflight(s.client, origin="https://anyone.example").headers["access-control-allow-origin"] == "*"
    r = s.client.get("/health", headers={"Origin": "https://anyone.example"})
    assert r.status_code == 200 and r.content == b"" and r.headers["access-control-allow-origin"] == "*"


# ---------------------------------------------------------------- /health, flags, origins
def test_health_through_the_middleware(served):
    s = served(api_key=KEY, allowed_origins=(ORIGIN,), log_requests=True)
    r = s.client.get("/health")
    assert r.status_code == 200 and r.content == b""
    asyncio.run(s.async_engine.drain(0))
    r = s.client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down" and r.headers["x-request-id"]


@pytest.mark.parametrize("origin, fix", [
    ("https://A.example", "write it as a browser sends it: https://a.example"),
    ("https://a.example/", "write it as a browser sends it: https://a.example"),
    ("https://a.example:443", "write it as a browser sends it: https://a.example"),
    ("a.example", "give scheme://host[:port]"),
    ("https://", "give scheme://host[:port]"),
])
def test_a_bad_origin_is_named_with_its_fix(origin, fix):
    with pytest.raises(DuokaError) as e:
        check_origins([ORIGIN, origin])
    assert repr(origin) in e.value.cause and e.value.fix.startswith(fix)


def test_origins_as_given():
    assert parse_origins(None) == parse_origins("") == ()
    assert parse_origins(" https://a.example, http://localhost:3000 ,") == ("https://a.example",
                                                                            "http://localhost:3000")
    assert check_origins(["*", "http://[::1]:8080", "chrome-extension://abcdef"]) == (
        "*", "http://[::1]:8080", "chrome-extension://abcdef")


def test_the_flags_reach_the_server(monkeypatch):
    from duoka import cli
    from duoka.launch import serving as launch_serving

    launched = []
    monkeypatch.setattr(cli, "use_compile_cache", lambda: None)
    monkeypatch.setattr(launch_serving, "launch_serving", lambda config, server, log: launched.append(server) or 0)
    a = cli.build_parser().parse_args(["serve", "--allowed-origins", "https://a.example,http://localhost:3000",
                                       "--log-requests"])
    assert a.func(a) == 0
    assert launched[0].allowed_origins == ("https://a.example", "http://localhost:3000")
    assert launched[0].log_requests is True
    a = cli.build_parser().parse_args(["serve"])
    a.func(a)
    assert launched[1].allowed_origins == () and launched[1].log_requests is False
    a = cli.build_parser().parse_args(["serve", "--allowed-origins", "https://a.example/"])
    with pytest.raises(DuokaError, match="'https://a.example/' is not an origin"):
        a.func(a)
    assert len(launched) == 2  # refused before anything started


def test_serve_checks_the_origins_before_the_model_loads():
    from duoka.host.ports import free_port
    from duoka.serve.server import serve

    def load():
        raise AssertionError("the engine was built")

    with pytest.raises(DuokaError, match="'app.example' is not an origin"):
        serve(load, port=free_port(), allowed_origins=("app.example",), log=lambda line: None)
