"""From the engine's outputs to OpenAI's responses: chat.completion / text_completion objects
and their SSE streams, with n choices, logprobs in OpenAI's two formats, and Hermes tool calls
read out of the text (serve.tool_calls). The request side is serve/api_requests.py.

As vLLM serves them (vllm/entrypoints/openai), so that the `openai` client and `vllm bench
serve` work unmodified:
- usage counted exactly (protocol.usage_body): with n choices, the prompt once and the
  completions summed;
- streams: server-sent events `data: {json}\\n\\n`; a chat choice's first chunk carries the
  role (sent with its first token, as vLLM does, so a client's time-to-first-token means the
  first token), its last content chunk carries finish_reason, then with
  stream_options.include_usage a chunk with `choices: []` and the usage, then `data: [DONE]`;
- a choice whose text holds well-formed tool calls ends with finish_reason "tool_calls";
  malformed ones stay plain content.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from duoka.errors import DuokaError
from duoka.serve.api_requests import Prepared, duoka_message
from duoka.serve.async_engine import AsyncEngine, EngineError, RequestStream, ServerBusy
from duoka.serve.params import RequestOutput
from duoka.serve.protocol import ApiError, CommonRequest, error_body, finite, usage_body
from duoka.serve.tool_calls import ToolCallStream, parse_tool_calls


def busy_code(e: ServerBusy) -> str:
    return {"QueueFull": "queue_full", "Draining": "server_shutting_down", "EngineDead": "engine_dead"}.get(
        type(e).__name__, "unavailable")


def busy_error(e: ServerBusy) -> ApiError:
    return ApiError(503, str(e), code=busy_code(e), headers={"Retry-After": str(e.retry_after_s)})


# A render turns one output of one choice into SSE events; `first` says whether it is the choice's first.
Render = Callable[[RequestOutput, bool], list[str]]


class Responder:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.token_text = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))

    async def _start(self, prepared: Prepared) -> list[RequestStream]:
        """The request's choices in the engine: choice i as its own request, the later ones
        told to wait for the first one's prompt and reuse its cache blocks."""
        n = len(prepared.choices)
        ids = [prepared.request_id] if n == 1 else [f"{prepared.request_id}-{i}" for i in range(n)]
        streams: list[RequestStream] = []
        try:
            for i, params in enumerate(prepared.choices):
                streams.append(await self.engine.generate(ids[i], prepared.prompt_ids, params, lora=prepared.lora,
                                                          after=ids[0] if i else None))
        except (DuokaError, ServerBusy) as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, ServerBusy):
                raise busy_error(e) from None
            raise ApiError(400, duoka_message(e)) from None
        return streams

    async def respond(self, request: Request, prepared: Prepared, body: CommonRequest, chat: bool):
        streams = await self._start(prepared)
        created = int(time.time())
        want_logprobs = prepared.params.logprobs is not None
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            base = {"id": prepared.request_id, "object": f"{kind}.chunk" if chat else kind, "created": created,
                    "model": body.model or self.model_name}
            if include_usage:
                base["usage"] = None  # OpenAI: every chunk has usage null but the last one
            make = self._chat_render if chat else self._completion_render
            renders = [make(base, i, want_logprobs, prepared.parse_tools) for i in range(len(streams))]
            # The background abort covers a client that left before the first event: Starlette
            # then never starts the generator, so its own `finally` would not run.
            return StreamingResponse(self._events(streams, base, include_usage, renders),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(_abort_all, streams),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collected = await _unless_disconnected(request, _collect_all(streams))
        if collected is None:  # the client went away; its request was aborted, nobody reads this
            return Response(status_code=499)
        failure = next((c for c in collected if isinstance(c, Exception)), None)
        if failure is not None:
            return _failure_response(failure)
        choices = [self._choice(i, text, outputs, chat, want_logprobs, prepared.parse_tools)
                   for i, (text, outputs) in enumerate(collected)]
        return {"id": prepared.request_id, "object": kind, "created": created, "model": body.model or self.model_name,
                "choices": choices, "usage": usage_body([outputs[-1] for _, outputs in collected])}

    def _choice(self, index: int, text: str, outputs: list[RequestOutput], chat: bool, want_logprobs: bool,
                parse_tools: bool) -> dict[str, Any]:
        logprobs = [lp for out in outputs for lp in (out.new_logprobs or [])]
        finish_reason = outputs[-1].finish_reason
        choice: dict[str, Any] = {"index": index}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if parse_tools:
                parsed = parse_tool_calls(text)
                if parsed.tool_calls:
                    message = {"role": "assistant", "content": parsed.content,
                               "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
                    finish_reason = "tool_calls"
            choice["message"] = message
            choice["logprobs"] = {"content": self._chat_logprobs(logprobs)} if want_logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(logprobs, 0) if want_logprobs else None
        choice["finish_reason"] = finish_reason
        return choice

    # Every output that carries tokens is an event, its text possibly empty (a token whose text
    # is held back, e.g. part of a UTF-8 character), as vLLM does: a client's time to first
    # token and inter-token latency then count tokens, not the tokens that happened to print.
    # The common event (a text delta, no logprobs, not the last) is built from a template made
    # once per choice, encoding only the text: the bytes are those _sse() would make of the
    # whole object (tests/unit/test_serve_sse_bytes.py compares them).
    def _chat_render(self, base: dict, index: int, want_logprobs: bool, parse_tools: bool) -> Render:
        def chunk(delta: dict, logprobs=None, finish_reason=None) -> str:
            return _sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish_reason}]})

        template = None if want_logprobs or parse_tools else _template(
            {**base, "choices": [{"index": index, "delta": {"content": _HOLE}, "logprobs": None,
                                  "finish_reason": None}]})
        tools = ToolCallStream() if parse_tools else None

        def render(out: RequestOutput, first: bool) -> list[str]:
            events = [chunk({"role": "assistant", "content": ""})] if first else []
            if template is not None and out.new_token_ids and not out.finished:
                events.append(f"{template[0]}{_encode_str(out.new_text)}{template[1]}")
            elif tools is not None:
                events += self._tool_events(tools, out, chunk, want_logprobs)
            elif out.new_token_ids or out.finished:
                logprobs = {"content": self._chat_logprobs(out.new_logprobs or [])} if want_logprobs else None
                events.append(chunk({"content": out.new_text} if out.new_text or not out.finished else {}, logprobs,
                                    out.finish_reason if out.finished else None))
            return events

        return render

    def _tool_events(self, tools: ToolCallStream, out: RequestOutput, chunk, want_logprobs: bool) -> list[str]:
        """One output's events when the text is read for tool calls: content and tool-call
        deltas as the parser releases them; the output's logprobs ride on its first event."""
        deltas = tools.feed(out.new_text) + (tools.finish() if out.finished else [])
        logprobs = {"content": self._chat_logprobs(out.new_logprobs or [])} if want_logprobs else None
        events = []
        for delta in deltas:
            events.append(chunk(delta.to_openai(), logprobs))
            logprobs = None
        if out.finished:
            reason = "tool_calls" if tools.calls else out.finish_reason
            events.append(chunk({}, logprobs, reason))
        elif not events and out.new_token_ids:  # a token whose text the parser holds back: still an event
            events.append(chunk({"content": ""}, logprobs))
        return events

    def _completion_render(self, base: dict, index: int, want_logprobs: bool, parse_tools: bool) -> Render:
        template = None if want_logprobs else _template(
            {**base, "choices": [{"index": index, "text": _HOLE, "logprobs": None, "finish_reason": None}]})
        offset = 0  # characters streamed so far: the logprobs' text offsets

        def render(out: RequestOutput, first: bool) -> list[str]:
            nonlocal offset
            if template is not None and out.new_token_ids and not out.finished:
                return [f"{template[0]}{_encode_str(out.new_text)}{template[1]}"]
            if not (out.new_token_ids or out.finished):
                return []
            logprobs = self._completion_logprobs(out.new_logprobs or [], offset) if want_logprobs else None
            offset += len(out.new_text)
            return [_sse({**base, "choices": [{"index": index, "text": out.new_text, "logprobs": logprobs,
                                               "finish_reason": out.finish_reason if out.finished else None}]})]

        return render

    async def _events(self, streams: list[RequestStream], base: dict, include_usage: bool,
                      renders: list[Render]) -> AsyncIterator[str | bytes]:
        """One streamed request's SSE body: each choice's outputs rendered as they come; then
        the usage event (when asked) and [DONE]. A failure mid-stream is an error event."""
        lasts: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, outs in _batches(streams):
                events = []
                render = renders[index]
                for out in outs:
                    events += render(out, lasts[index] is None)
                    lasts[index] = out
                if events:
                    yield "".join(events).encode()
        except (EngineError, ServerBusy) as e:
            yield _sse(_failure_body(e))
            yield "data: [DONE]\n\n"
            return
        finally:
            _abort_all(streams)  # a no-op once finished; a client that left gets its requests aborted here
        if include_usage and all(last is not None for last in lasts):
            yield _sse({**base, "choices": [], "usage": usage_body(lasts)})
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


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def _next_batch(stream: RequestStream) -> list[RequestOutput] | None:
    try:
        return await stream.next_batch()
    except StopAsyncIteration:
        return None


async def _batches(streams: list[RequestStream]) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
    """(choice index, outputs) as they arrive from the choices' streams, until all have ended."""
    if len(streams) == 1:  # the common case, without a task per wait
        while (outs := await _next_batch(streams[0])) is not None:
            yield 0, outs
        return
    pending = {asyncio.ensure_future(_next_batch(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                outs = task.result()
                if outs is not None:
                    yield index, outs
                    pending[asyncio.ensure_future(_next_batch(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()


async def _collect_all(streams: list[RequestStream]) -> list:
    """Every choice's (text, outputs), or its failure. A coroutine, not a bare gather: cancelled
    as a Task it ends cancelled, where a cancelled gather future ends holding a CancelledError."""
    return await asyncio.gather(*(_collect(s) for s in streams))


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
    """Run `work`, unless the client disconnects first: then cancel it (its streams abort the
    requests in the engine) and return None. uvicorn does not cancel a handler whose client
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
        return error_body(503, str(e), code=busy_code(e))
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
