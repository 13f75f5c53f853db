"""Every OpenAI request parameter of /v1/chat/completions and /v1/completions, with what duoka
serve does with it: the table in docs/serving.md is generated from PARAMETERS
(`python -m duoka.serve.openai_parameters --update docs/serving.md`), and
tests/unit/test_openai_parameters.py checks that every field of the request schemas is listed
and that every refused one is refused with a 400 naming it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from duoka.serve.config import update_section

CHAT, COMPLETIONS, BOTH = "chat", "completions", "chat, completions"
SUPPORTED, REFUSED, IGNORED = "supported", "refused (400)", "accepted, no effect"

DOCS_BEGIN = "<!-- openai parameters: generated from duoka/serve/openai_parameters.py, do not edit by hand -->"
DOCS_END = "<!-- end of openai parameters -->"


@dataclass(frozen=True)
class Parameter:
    name: str
    endpoints: str
    status: str
    note: str


PARAMETERS = (
    Parameter("model", BOTH, SUPPORTED, "the served name (`--served-model-name`) or a `--lora` adapter's name; "
                                         "omitted: the base model"),
    Parameter("messages", CHAT, SUPPORTED, "roles system, developer (as system), user, assistant (with "
                                             "`tool_calls`), tool (with `tool_call_id`); text content parts only"),
    Parameter("prompt", COMPLETIONS, SUPPORTED, "a string, token ids, or a list of strings or of token-id lists: "
                                                  "one choice per prompt (with n: index = prompt index x n + choice), "
                                                  "each prompt a sequence of its own in the batch"),
    Parameter("max_tokens", BOTH, SUPPORTED, "default: what the context leaves; completions: 0 with echo scores the "
                                               "prompt and generates nothing (without echo, a 400)"),
    Parameter("max_completion_tokens", CHAT, SUPPORTED, "as max_tokens, and wins over it"),
    Parameter("temperature", BOTH, SUPPORTED, "0 = greedy"),
    Parameter("top_p", BOTH, SUPPORTED, ""),
    Parameter("top_k", BOTH, SUPPORTED, "vLLM's; 0 or -1 = off"),
    Parameter("min_p", BOTH, SUPPORTED, "vLLM's; after temperature"),
    Parameter("seed", BOTH, SUPPORTED, "the same seed gives the same text, whatever else is in the batch; with n, "
                                         "choice i uses seed + i"),
    Parameter("n", BOTH, SUPPORTED, "up to 16 choices; they share the prompt's KV-cache blocks"),
    Parameter("best_of", COMPLETIONS, REFUSED, "unless equal to n: ranking choices is not implemented"),
    Parameter("stop", BOTH, SUPPORTED, "up to 16 strings; the text ends before the first one"),
    Parameter("stop_token_ids", BOTH, SUPPORTED, "vLLM's"),
    Parameter("ignore_eos", BOTH, SUPPORTED, "vLLM's"),
    Parameter("min_tokens", BOTH, SUPPORTED, "vLLM's: no stop token id before this many tokens"),
    Parameter("presence_penalty", BOTH, SUPPORTED, "OpenAI's formula, on the output so far"),
    Parameter("frequency_penalty", BOTH, SUPPORTED, "OpenAI's formula, on the output so far"),
    Parameter("repetition_penalty", BOTH, SUPPORTED, "vLLM's / transformers': on prompt and output tokens"),
    Parameter("logit_bias", BOTH, SUPPORTED, "token id -> bias in [-100, 100], added to the logits"),
    Parameter("logprobs", BOTH, SUPPORTED, "chat: true/false; completions: 0-20 alternatives (with echo, the "
                                             "prompt's tokens too)"),
    Parameter("top_logprobs", CHAT, SUPPORTED, "0-20, with logprobs=true"),
    Parameter("response_format", BOTH, SUPPORTED, "text, json_object, json_schema: enforced by a token mask "
                                                    "(xgrammar); JSON comes compact"),
    Parameter("tools", CHAT, SUPPORTED, "functions, through the model's chat template (Hermes format for Qwen2)"),
    Parameter("tool_choice", CHAT, SUPPORTED, "auto, none, required, or a named function; required and named "
                                                "are enforced by a token mask (one call)"),
    Parameter("parallel_tool_calls", CHAT, IGNORED, "several `<tool_call>` blocks are always read"),
    Parameter("stream", BOTH, SUPPORTED, "server-sent events"),
    Parameter("stream_options", BOTH, SUPPORTED, "include_usage; only with stream=true"),
    Parameter("user", BOTH, IGNORED, ""),
    Parameter("echo", COMPLETIONS, SUPPORTED, "the text starts with the prompt; with logprobs, the prompt's tokens "
                                                "come first (the first with null), from the prefill's own logits; "
                                                "the prefix cache serves such a prompt the blocks an earlier one "
                                                "scored"),
    Parameter("prompt_logprobs", BOTH, SUPPORTED, "vLLM's: 0-20; each prompt token's logprob, rank and alternatives "
                                                    "(per choice on completions, once on chat); not with stream; the "
                                                    "prefix cache serves the blocks an earlier such prompt scored"),
    Parameter("return_tokens_as_token_ids", BOTH, SUPPORTED, "vLLM's: logprobs name tokens `token_id:N`, so "
                                                               "different tokens with the same text stay apart"),
    Parameter("suffix", COMPLETIONS, REFUSED, "Qwen2 has no fill-in-the-middle"),
    Parameter("use_beam_search", BOTH, REFUSED, "vLLM's; beam search is not implemented"),
)


def reference_markdown() -> str:
    out = [DOCS_BEGIN, "", "| parameter | endpoints | status | notes |", "|---|---|---|---|"]
    out += [f"| `{p.name}` | {p.endpoints} | {p.status} | {p.note} |" for p in PARAMETERS]
    return "\n".join(out + ["", DOCS_END])


def update_docs(path: Path) -> None:
    update_section(path, DOCS_BEGIN, DOCS_END, reference_markdown())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"] and len(sys.argv) == 3:
        update_docs(Path(sys.argv[2]))
    else:
        print(reference_markdown())
