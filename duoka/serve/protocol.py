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
known fields whose non-default values duoka cannot honour (n > 1, tools, echo, ...) are a
400 rather than a silent difference.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from duoka.serve.params import MAX_LOGPROBS, RequestOutput

# JSON has no -inf; a token the model rules out entirely gets vLLM's stand-in value.
LOGPROB_FLOOR = -9999.0
# The largest request body read. Qwen2's longest context (131,072 tokens) is under 1 MiB as
# JSON token ids or as text; past this a body is refused (413) before it is parsed or
# tokenized, so one client cannot make the server hold and parse gigabytes.
MAX_BODY_BYTES = 16 * 2**20


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
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Known fields whose non-default values duoka does not implement: refused, not ignored.
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, Any] | None = None
    tools: list[Any] | None = None
    use_beam_search: bool = False
    repetition_penalty: float | None = None  # vLLM's; `vllm bench serve` sends 1.0, which changes nothing
    min_p: float | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def refuse_unsupported(body: CommonRequest) -> None:
    """A 400 for a field duoka cannot honour, rather than an answer that silently differs."""
    if body.n > 1:
        raise ApiError(400, f"n={body.n}: n>1 is not supported yet; send n separate requests (each with its own seed)",
                       param="n")
    unsupported = [("min_tokens", body.min_tokens > 0), ("logit_bias", bool(body.logit_bias)),
                   ("tools", bool(body.tools)), ("use_beam_search", body.use_beam_search),
                   ("repetition_penalty", body.repetition_penalty not in (None, 1.0)), ("min_p", bool(body.min_p))]
    if isinstance(body, CompletionRequest):
        unsupported += [("echo", body.echo), ("suffix", bool(body.suffix)), ("best_of", (body.best_of or 1) > 1)]
    for name, asked in unsupported:
        if asked:
            raise ApiError(400, f"{name} is not supported by duoka serve yet; leave it out of the request", param=name)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")


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
    return out


# ---------------------------------------------------------------- response parts
def usage_body(out: RequestOutput) -> dict:
    """A request's usage object, from its last output."""
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def finite(value: float) -> float:
    """A logprob as JSON can carry it."""
    return value if math.isfinite(value) else LOGPROB_FLOOR
