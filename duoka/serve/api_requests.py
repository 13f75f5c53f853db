"""From an OpenAI request body to what the engine runs: each prompt's token ids (through the
chat template, with the request's tools; a completions request may carry a list of prompts),
the SamplingParams of each prompt's n choices, the adapter its `model` names, its
structured-output grammar, and what the response shows (echo, prompt logprobs, tokens as
ids). Every refusal is an ApiError (a 400 naming the parameter). The responses are
serve/api_responses.py; the routes serve/api.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, replace
from typing import Any

from duoka.errors import DuokaError
from duoka.serve.params import SamplingParams, StructuredOutput
from duoka.serve.protocol import (
    ApiError,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    chat_message_dict,
    refuse_unsupported,
)
from duoka.serve.structured import check_spec
from duoka.serve.tool_calls import ToolSpecError, template_messages, tool_choice_schema

# Request fields passed to SamplingParams as they are, when the request sets them.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_p", "min_tokens")


def duoka_message(e: DuokaError) -> str:
    return e.cause if e.fix is None else f"{e.cause}; fix: {e.fix}"


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt of a request: choice i runs with choices[i] (n > 1: seeds differ). Only
    choice 0 computes the prompt logprobs; the other choices show its (they share the prompt)."""
    prompt_ids: list[int]
    choices: tuple[SamplingParams, ...]
    echo_text: str | None = None
    """With echo: the text each choice's text starts with (the prompt as sent, or its ids decoded)."""


@dataclass(frozen=True)
class Prepared:
    """One request, ready for the engine: its prompts in order, each with its n choices; the
    response's choice index is prompt index * n + choice (OpenAI's order)."""
    request_id: str
    prompts: tuple[PreparedPrompt, ...]
    lora: str | None = None
    """The adapter the request's model names; None: the base model."""
    parse_tools: bool = False
    """The output is read for Hermes tool calls (tools given and tool_choice is not "none")."""
    echo: bool = False
    """Completions: each choice's text, and its logprobs, start with its prompt's."""
    show_prompt_logprobs: bool = False
    """The response carries vLLM's prompt_logprobs (per choice for completions, once for chat)."""
    tokens_as_ids: bool = False
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", not by their text."""

    @property
    def params(self) -> SamplingParams:
        return self.prompts[0].choices[0]

    @property
    def n(self) -> int:
        return len(self.prompts[0].choices)


@dataclass(frozen=True)
class ServedModels:
    """What `model` may name: the base model, or one of its --lora adapters."""
    base: str
    adapters: tuple[str, ...] = ()

    def lora_for(self, model: str | None) -> str | None:
        if model is None or model == self.base:
            return None
        if model in self.adapters:
            return model
        raise self.not_found(model)

    def not_found(self, model: str) -> ApiError:
        """OpenAI's answer for a model it does not have: 404, code model_not_found (the
        openai client raises NotFoundError)."""
        served = ", ".join(repr(m) for m in (self.base, *self.adapters))
        return ApiError(404, f"the model {model!r} does not exist here; this server serves {served} (GET /v1/models "
                             "lists them): name one of those in \"model\"", param="model", code="model_not_found")


class RequestPreparer:
    def __init__(self, tokenizer, models: ServedModels, max_model_len: int, default_params: dict[str, Any]):
        self.tokenizer = tokenizer
        self.models = models
        self.max_model_len = max_model_len
        self.default_params = default_params

    async def prepare_chat(self, body: ChatRequest) -> Prepared:
        lora = self.models.lora_for(body.model)
        refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [chat_message_dict(i, m) for i, m in enumerate(body.messages)]
        tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        try:
            messages = template_messages(messages)
            schema = tool_choice_schema(body.tools, tool_choice) if body.tools or body.tool_choice else None
        except ToolSpecError as e:
            raise ApiError(400, str(e), param=e.param) from None
        # tool_choice "none": the template shows no tools, so the model is not invited to call one.
        tools = body.tools if body.tools and tool_choice != "none" else None
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                           tokenize=False, tools=tools)
        except DuokaError as e:
            raise ApiError(400, duoka_message(e), param="messages") from None
        prompt_ids = await self._encode(text, "messages", add_special_tokens=False)
        structured = await self._structured(body, schema)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt = PreparedPrompt(list(prompt_ids), self._choices(len(prompt_ids), body, max_tokens, logprobs,
                                                                 body.prompt_logprobs, "messages", structured))
        return Prepared(f"chatcmpl-{uuid.uuid4().hex}", (prompt,), lora, parse_tools=tools is not None,
                        show_prompt_logprobs=body.prompt_logprobs is not None,
                        tokens_as_ids=body.return_tokens_as_token_ids)

    async def prepare_completion(self, body: CompletionRequest) -> Prepared:
        lora = self.models.lora_for(body.model)
        refuse_unsupported(body)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens=0 generates nothing, so without echo the answer would be empty: it is for "
                                "scoring a prompt (echo=true with logprobs=k answers the prompt's tokens and their "
                                "logprobs); fix: set echo=true, or ask for at least 1 token", param="max_tokens")
        # vLLM's rule: echo with logprobs=k asks for the prompt's logprobs with k alternatives.
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = body.logprobs
        structured = await self._structured(body, None)
        given = _prompt_list(body.prompt)
        prompts = []
        for j, prompt in enumerate(given):
            param = "prompt" if len(given) == 1 else f"prompt.{j}"
            ids = await self._prompt_ids(prompt, param, body.max_tokens == 0)
            echo = None
            if body.echo:  # the prompt as sent, or its ids as text
                echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(self.tokenizer.decode, ids)
            choices = self._choices(len(ids), body, body.max_tokens, body.logprobs, prompt_logprobs, param, structured)
            prompts.append(PreparedPrompt(ids, choices, echo))
        return Prepared(f"cmpl-{uuid.uuid4().hex}", tuple(prompts), lora, echo=body.echo,
                        show_prompt_logprobs=body.prompt_logprobs is not None,
                        tokens_as_ids=body.return_tokens_as_token_ids)

    async def _prompt_ids(self, prompt: str | list[int], param: str, scoring: bool) -> list[int]:
        """One prompt's token ids: a string tokenized, ids checked. A prompt that generates
        nothing (scoring) may fill the whole context."""
        if isinstance(prompt, str):
            return await self._encode(prompt, param, limit=self.max_model_len - (0 if scoring else 1))
        bad = [t for t in prompt if t < 0]
        if bad:
            raise ApiError(400, f"{param} token id {bad[0]} is negative", param=param)
        return list(prompt)

    async def _structured(self, body: CommonRequest, tool_schema: dict | None) -> StructuredOutput | None:
        """The grammar the output must follow: response_format's, or a forced tool call's."""
        fmt = body.response_format
        kind = fmt.type if fmt is not None else "text"
        if tool_schema is not None and kind != "text":
            raise ApiError(400, "response_format and a forced tool call (tool_choice \"required\" or a named function) "
                                "cannot both constrain the output; drop one of them", param="response_format")
        if tool_schema is not None:
            spec = StructuredOutput("tool_call", json.dumps(tool_schema), "tool_choice")
        elif kind == "json_object":
            spec = StructuredOutput("json_object", "", "response_format")
        elif kind == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema.schema (a JSON schema "
                                    "object)", param="response_format.json_schema")
            spec = StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_), fmt.json_schema.name)
        else:
            return None
        try:
            await asyncio.to_thread(check_spec, spec)
        except DuokaError as e:
            raise ApiError(400, duoka_message(e), param="tool_choice" if tool_schema else "response_format") from None
        return spec

    async def _encode(self, text: str, param: str, add_special_tokens: bool = True,
                      limit: int | None = None) -> list[int]:
        """The prompt's ids, tokenized on a worker thread (tokenizers releases the GIL for long
        text: the event loop keeps serving), and refused from a prefix when it holds more than
        limit tokens (default: the context less one token of output)."""
        limit = self.max_model_len - 1 if limit is None else limit
        ids = await asyncio.to_thread(self.tokenizer.encode_at_most, text, limit, add_special_tokens)
        if ids is None:
            raise ApiError(400, f"the prompt ({len(text):,} characters) holds more than {limit} tokens, the most this "
                                f"model's maximum context of {self.max_model_len} tokens leaves room for; fix: shorten "
                                "the prompt", param=param, code="context_length_exceeded")
        return ids

    def _check_length(self, n: int, max_tokens: int | None, prompt_param: str) -> int:
        """max_tokens, checked against the context (or as much as the context leaves)."""
        limit = self.max_model_len
        if n == 0:
            raise ApiError(400, "the prompt is empty (0 tokens); give at least one token", param=prompt_param)
        if n > limit or (n == limit and max_tokens != 0):  # max_tokens 0 (scoring) needs no room for output
            most = limit if max_tokens == 0 else limit - 1
            raise ApiError(400, f"the prompt has {n} tokens, but this model's maximum context length is {limit} "
                                "tokens, which leaves no room for output; fix: shorten the prompt to at most "
                                f"{most} tokens", param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the request asks for "
                                f"{n + max_tokens}: {n} in the prompt and {max_tokens} in max_tokens; fix: lower "
                                f"max_tokens to {limit - n} or less, or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")
        if max_tokens is None:  # OpenAI: as long as the context allows; a model default may say less
            max_tokens = min(limit - n, self.default_params.get("max_tokens", limit))
        return max_tokens

    def _choices(self, num_prompt_tokens: int, body: CommonRequest, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None, prompt_param: str,
                 structured: StructuredOutput | None) -> tuple[SamplingParams, ...]:
        """The SamplingParams of one prompt's n choices."""
        max_tokens = self._check_length(num_prompt_tokens, max_tokens, prompt_param)
        fields = {**self.default_params, "max_tokens": max_tokens, "ignore_eos": body.ignore_eos, "logprobs": logprobs,
                  "structured": structured, "prompt_logprobs": prompt_logprobs}
        for name in _SAMPLING_FIELDS:
            value = getattr(body, name)
            if value is not None:
                fields[name] = value
        if body.stop is not None:
            fields["stop"] = body.stop
        if body.stop_token_ids is not None:
            fields["stop_token_ids"] = body.stop_token_ids
        if body.logit_bias:
            fields["logit_bias"] = body.logit_bias
        try:
            params = SamplingParams(**fields)
            # n choices: the same request n times, each with its own draw. A given seed gives
            # choice i the seed + i (vLLM's rule), so the same seed gives the same n texts.
            # Choice 0 alone computes the prompt logprobs; the others reuse its cached prompt.
            return tuple(params if i == 0 else
                         replace(params, prompt_logprobs=None,
                                 seed=params.seed if params.seed is None else _wrap_seed(params.seed + i))
                         for i in range(body.n))
        except DuokaError as e:  # SamplingParams names the field first: it is the parameter
            param = next((name for name in sorted(fields, key=len, reverse=True) if e.cause.startswith(name)), None)
            raise ApiError(400, duoka_message(e), param=param) from None


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's prompt forms as a list of prompts: a string or token ids is one; a list of
    strings or of token-id lists is one each, in order."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _wrap_seed(seed: int) -> int:
    """seed + i kept in SamplingParams' signed 64-bit range."""
    return (seed + 2**63) % 2**64 - 2**63
