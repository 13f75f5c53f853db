"""From the engine's outputs to OpenAI's responses: chat.completion / text_completion objects
and their SSE streams, with n choices per prompt (and a completions request's list of
prompts: choice index = prompt index * n + choice), logprobs (serve.api_logprobs), echo and
prompt logprobs, and Hermes tool calls read out of the text (serve.tool_calls). The request
side is serve/api_requests.py.

As vLLM serves them (vllm/entrypoints/openai), so that the `openai` client and `vllm bench
serve` work unmodified:
- usage counted exactly (protocol.usage_body): with n choices, the prompt once and the
  completions summed;
- streams: server-sent events `data: {json}\\n\\n`; a chat choice's first chunk carries the
  role (sent with its first token, as vLLM does, so a client's time-to-first-token means the
  first token), its last content chunk carries finish_reason, then with
  stream_options.include_usage a chunk with `choices: []` and the usage, then `data: [DONE]`;
- a choice whose text holds well-formed tool calls ends with finish_reason "tool_calls";
  malformed ones stay plain content;
- echo (completions): a choice's text, and its logprobs, start with its prompt's; streamed,
  in its first event. A prompt's logprobs are computed by its choice 0 only and shown in
  each of its choices (the others come later: they wait for choice 0's prompt).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from duoka.errors import DuokaError
from duoka.serve.api_logprobs import (
    TokenName,
    Tokens,
    chat_logprobs,
    completion_logprobs,
    echoed,
    echoed_logprobs,
    generated,
    joined,
    token_id_name,
    vllm_prompt_logprobs,
)
from duoka.serve.api_requests import Prepared, PreparedPrompt, duoka_message
from duoka.serve.async_engine import AsyncEngine, EngineError, RequestStream, ServerBusy
from duoka.serve.params import RequestOutput, TokenLogprob
from duoka.serve.protocol import ApiError, CommonRequest, error_body, json_response, usage_body
from duoka.serve.tool_calls import ToolCallStream, parse_tool_calls


def busy_code(e: ServerBusy) -> str:
    return {"QueueFull": "queue_full", "Draining": "server_shutting_down", "EngineDead": "engine_dead"}.get(
        type(e).__name__, "unavailable")


def busy_error(e: ServerBusy) -> ApiError:
    return ApiError(503, str(e), code=busy_code(e), headers={"Retry-After": str(e.retry_after_s)})


# A render turns one output of one choice into SSE events; `first` says whether it is the choice's first.
Render = Callable[[RequestOutput, bool], list[str]]


class PromptShown:
    """One prompt as its choices show it: the echoed text, and the prompt logprobs that its
    choice 0 computed (their first output carries them; the other choices' outputs come after)."""

    def __init__(self, prompt: PreparedPrompt):
        self.ids = prompt.prompt_ids
        self.text = prompt.echo_text or ""
        self.logprobs: Sequence[TokenLogprob | None] | None = None

    def seen(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.logprobs = out.prompt_logprobs

    def tokens(self) -> Tokens:
        return echoed(self.ids, self.logprobs)


class Responder:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.token_text = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))

    async def _start(self, prepared: Prepared) -> list[RequestStream]:
        """The request's choices in the engine, all queued at once (in order: the inbox keeps
        it), each as its own request; a prompt's later choices are told to wait for its first
        one's prompt and reuse its cache blocks."""
        n = prepared.n
        total = n * len(prepared.prompts)
        ids = [prepared.request_id] if total == 1 else [f"{prepared.request_id}-{i}" for i in range(total)]
        starts = [self.engine.generate(ids[j * n + i], prompt.prompt_ids, params, lora=prepared.lora,
                                       after=ids[j * n] if i else None)
                  for j, prompt in enumerate(prepared.prompts) for i, params in enumerate(prompt.choices)]
        started = await asyncio.gather(*starts, return_exceptions=True)
        failure = next((e for e in started if isinstance(e, BaseException)), None)
        if failure is None:
            return started
        for stream in started:
            if isinstance(stream, RequestStream):
                stream.abort()
        if isinstance(failure, ServerBusy):
            raise busy_error(failure) from None
        if isinstance(failure, DuokaError):
            raise ApiError(400, duoka_message(failure)) from None
        raise failure

    def _name(self, prepared: Prepared) -> TokenName:
        return token_id_name if prepared.tokens_as_ids else self.token_text

    async def respond(self, request: Request, prepared: Prepared, body: CommonRequest, chat: bool):
        streams = await self._start(prepared)
        created = int(time.time())
        want_logprobs = prepared.params.logprobs is not None
        kind = "chat.completion" if chat else "text_completion"
        name = self._name(prepared)
        shown = [PromptShown(prompt) for prompt in prepared.prompts]
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            base = {"id": prepared.request_id, "object": f"{kind}.chunk" if chat else kind, "created": created,
                    "model": body.model or self.model_name}
            if include_usage:
                base["usage"] = None  # OpenAI: every chunk has usage null but the last one
            if chat:
                renders = [self._chat_render(base, i, want_logprobs, prepared.parse_tools, name)
                           for i in range(len(streams))]
            else:
                renders = [self._completion_render(base, i, want_logprobs, name,
                                                   shown[i // prepared.n] if prepared.echo else None)
                           for i in range(len(streams))]
            # The background abort covers a client that left before the first event: Starlette
            # then never starts the generator, so its own `finally` would not run.
            return StreamingResponse(self._events(streams, base, include_usage, renders, prepared.n),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(_abort_all, streams),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collected = await unless_disconnected(request, _collect_all(streams))
        if collected is None:  # the client went away; its request was aborted, nobody reads this
            return Response(status_code=499)
        failure = next((c for c in collected if isinstance(c, Exception)), None)
        if failure is not None:
            return _failure_response(failure)
        for i, (_, outputs) in enumerate(collected):  # index order: each prompt's choice 0 first
            shown[i // prepared.n].seen(outputs[0])
        response = {"id": prepared.request_id, "object": kind, "created": created,
                    "model": body.model or self.model_name}
        if chat:
            response["choices"] = [self._chat_choice(i, text, outputs, want_logprobs, prepared.parse_tools, name)
                                   for i, (text, outputs) in enumerate(collected)]
            if prepared.show_prompt_logprobs:  # vLLM's: once, beside the choices
                response["prompt_logprobs"] = vllm_prompt_logprobs(shown[0].logprobs, name)
        else:
            response["choices"] = [self._completion_choice(i, text, outputs, want_logprobs, prepared,
                                                           shown[i // prepared.n], name)
                                   for i, (text, outputs) in enumerate(collected)]
        response["usage"] = usage_body([outputs[-1] for _, outputs in collected], prepared.n)
        return json_response(response)

    def _completion_choice(self, index: int, text: str, outputs: list[RequestOutput], want_logprobs: bool,
                           prepared: Prepared, shown: PromptShown, name: TokenName) -> dict[str, Any]:
        tokens = generated([lp for out in outputs for lp in (out.new_logprobs or [])])
        logprobs = None
        if prepared.echo:
            text = shown.text + text
            if want_logprobs:
                logprobs = joined(echoed_logprobs(shown.ids, shown.logprobs, name), tokens, name)
        elif want_logprobs:
            logprobs = completion_logprobs(tokens, name, 0)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": outputs[-1].finish_reason}
        if prepared.show_prompt_logprobs:  # vLLM's, per choice
            choice["prompt_logprobs"] = vllm_prompt_logprobs(shown.logprobs, name)
        return choice

    def _chat_choice(self, index: int, text: str, outputs: list[RequestOutput], want_logprobs: bool,
                     parse_tools: bool, name: TokenName) -> dict[str, Any]:
        logprobs = [lp for out in outputs for lp in (out.new_logprobs or [])]
        finish_reason = outputs[-1].finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parse_tools:
            parsed = parse_tool_calls(text)
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
                finish_reason = "tool_calls"
        return {"index": index, "message": message,
                "logprobs": {"content": chat_logprobs(logprobs, name)} if want_logprobs else None,
                "finish_reason": finish_reason}

    # Every output that carries tokens is an event, its text possibly empty (a token whose text
    # is held back, e.g. part of a UTF-8 character), as vLLM does: a client's time to first
    # token and inter-token latency then count tokens, not the tokens that happened to print.
    # The common event (a text delta, no logprobs, not the last) is built from a template made
    # once per choice, encoding only the text: the bytes are those _sse() would make of the
    # whole object (tests/unit/test_serve_sse_bytes.py compares them).
    def _chat_render(self, base: dict, index: int, want_logprobs: bool, parse_tools: bool, name: TokenName) -> Render:
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
                events += self._tool_events(tools, out, chunk, want_logprobs, name)
            elif out.new_token_ids or out.finished:
                logprobs = {"content": chat_logprobs(out.new_logprobs or [], name)} if want_logprobs else None
                events.append(chunk({"content": out.new_text} if out.new_text or not out.finished else {}, logprobs,
                                    out.finish_reason if out.finished else None))
            return events

        return render

    def _tool_events(self, tools: ToolCallStream, out: RequestOutput, chunk, want_logprobs: bool,
                     name: TokenName) -> list[str]:
        """One output's events when the text is read for tool calls: content and tool-call
        deltas as the parser releases them; the output's logprobs ride on its first event."""
        deltas = tools.feed(out.new_text) + (tools.finish() if out.finished else [])
        logprobs = {"content": chat_logprobs(out.new_logprobs or [], name)} if want_logprobs else None
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

    def _completion_render(self, base: dict, index: int, want_logprobs: bool, name: TokenName,
                           echo: PromptShown | None) -> Render:
        """echo: the prompt the choice's first event starts with (its text, and its tokens in the logprobs)."""
        template = None if want_logprobs else _template(
            {**base, "choices": [{"index": index, "text": _HOLE, "logprobs": None, "finish_reason": None}]})
        offset = 0  # characters streamed so far: the logprobs' text offsets

        def render(out: RequestOutput, first: bool) -> list[str]:
            nonlocal offset
            echoing = first and echo is not None
            if template is not None and out.new_token_ids and not out.finished and not echoing:
                return [f"{template[0]}{_encode_str(out.new_text)}{template[1]}"]
            if not (out.new_token_ids or out.finished):
                return []
            text, tokens = out.new_text, generated(out.new_logprobs or [])
            if echoing:
                echo.seen(out)
                text, tokens = echo.text + text, echo.tokens() + tokens
            logprobs = completion_logprobs(tokens, name, offset) if want_logprobs else None
            offset += len(text)
            return [_sse({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                               "finish_reason": out.finish_reason if out.finished else None}]})]

        return render

    async def _events(self, streams: list[RequestStream], base: dict, include_usage: bool,
                      renders: list[Render], n: int) -> AsyncIterator[str | bytes]:
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
            yield _sse({**base, "choices": [], "usage": usage_body(lasts, n)})
        yield "data: [DONE]\n\n"


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


async def unless_disconnected(request: Request, work):
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
