"""The OpenAI API's wire formats as duoka serve speaks them: the request bodies (pydantic
schemas) with their validation and limits, the error object, and the parts of a response
that do not depend on the server (usage, logprob values). The routes, the middleware and the
SSE stream are serve/api.py.

Formats follow OpenAI's API as vLLM implements it (vllm/entrypoints/openai/protocol.py), so
that the `openai` client and `vllm bench serve` work unmodified:
- usage is counted exactly: prompt tokens = the token ids the engine got, after the chat
  template; completion tokens = what the engine generated, a stop token id included;
- errors are `{"error": {"message", "type", "param", "code"}}`.

Unknown extra fields are accepted and ignored, as OpenAI-compatible servers do; known
fields are validated strictly (a string where a number belongs is a 400, not coerced), and
known fields whose non-default values duoka cannot honour (suffix, beam search, ...) are a
400 rather than a silent difference. PARAMETERS lists every field with what duoka does with
it; docs/serving.md's table of OpenAI parameters is generated from it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
import pydantic_core
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from duoka.serve.params import LOGPROB_FLOOR, MAX_LOGPROBS, RequestOutput
# The largest request body read. Qwen2's longest context (131,072 tokens) is under 1 MiB as
# JSON token ids or as text; past this a body is refused (413) before it is parsed or
# tokenized, so one client cannot make the server hold and parse gigabytes.
MAX_BODY_BYTES = 16 * 2**20
# The most choices one request may ask for: each is a sequence of its own in the batch, so n
# multiplies a request's share of the engine (OpenAI allows 128; vLLM sets no bound).
MAX_CHOICES = 16


def json_response(body: dict) -> Response:
    """A whole response body as compact UTF-8 JSON, serialised by pydantic-core (Rust) and
    handed to Starlette as bytes: returning the dict would send it through FastAPI's
    jsonable_encoder and json.dumps, which took ~45% of the server's CPU on an echo-logprobs
    scoring workload (lm-eval; bench/NOTES.md 33). Non-finite floats, which the API guards
    (protocol.finite), would be null here rather than invalid JSON."""
    return Response(pydantic_core.to_json(body, inf_nan_mode="null"), media_type="application/json")


# ---------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _error_type(status: int) -> str:
    # OpenAI's types: a client's mistake (the key included) is an invalid_request_error.
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _error_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first error as (message, param): 'messages.0.role: Input should be ...'."""
    errors = exc.errors()
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({detail} at character {first['loc'][-1]})", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return ("the request body must be a JSON object, sent with 'Content-Type: application/json' "
                f"({first.get('msg', 'invalid')})"), None
    param = ".".join(loc)
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{param}: {first.get('msg', 'invalid value')}{more}", param


# ---------------------------------------------------------------- request bodies
class _Body(BaseModel):
    # strict: "5" is not an integer and "yes" not a boolean (OpenAI refuses them too);
    # extra="allow": fields of newer clients and other servers pass and are ignored.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CommonRequest(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # vLLM's
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    response_format: ResponseFormat | None = None
    # vLLM's: each prompt token's logprob and its k alternatives, in the response's prompt_logprobs.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    # Known fields whose non-default values duoka does not implement: refused, not ignored.
    use_beam_search: bool = False


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # several <tool_call> blocks are parsed either way


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def refuse_unsupported(body: CommonRequest) -> None:
    """A 400 for a field duoka cannot honour, rather than an answer that silently differs."""
    unsupported = [("use_beam_search", body.use_beam_search)]
    if isinstance(body, CompletionRequest):
        # best_of = n asks for nothing more than n; more would need choices ranked and dropped.
        unsupported += [("suffix", bool(body.suffix)), ("best_of", body.best_of is not None and body.best_of != body.n)]
    for name, asked in unsupported:
        if asked:
            raise ApiError(400, f"{name} is not supported by duoka serve; leave it out of the request", param=name)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:  # as vLLM: they come whole, before any token
        raise ApiError(400, "prompt_logprobs is not available with stream=true; fix: leave out stream (or, on "
                            "/v1/completions, use echo=true with logprobs, which streams)", param="prompt_logprobs")


def chat_message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """messages[index] as the chat template takes it: its text parts joined, its role one a template knows."""
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise ApiError(400, f"messages.{index}.content is missing (only an assistant message may omit it)",
                           param=f"messages.{index}.content")
        content = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages.{index}.content.{j}: only text parts ({{\"type\": \"text\", \"text\": "
                                    f"...}}) are supported, got type {part.get('type')!r}",
                               param=f"messages.{index}.content.{j}")
            texts.append(part["text"])
        content = "\n".join(texts)  # vLLM's "string" content format joins text parts with newlines
    # "developer" is OpenAI's newer name for the system role; chat templates know "system".
    out = {"role": "system" if message.role == "developer" else message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:  # serve.tool_calls.template_messages shapes them for the template
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


# ---------------------------------------------------------------- response parts
def usage_body(lasts: list[RequestOutput], n: int = 1) -> dict:
    """A request's usage object, from each choice's last output (n choices per prompt, in
    order): each prompt counted once (its choices share it), the completions summed."""
    firsts = lasts[::n]
    prompt, completion = sum(out.num_prompt_tokens for out in firsts), sum(out.num_output_tokens for out in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in firsts)}}


def finite(value: float) -> float:
    """A logprob as JSON can carry it."""
    return value if math.isfinite(value) else LOGPROB_FLOOR
