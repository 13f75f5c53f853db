"""Logprobs as the OpenAI API writes them, from the engine's TokenLogprob entries: chat's list
of entries (token, logprob, bytes, top_logprobs); completions' four parallel lists (tokens,
token_logprobs, top_logprobs, text_offset), where with echo the prompt's tokens come first,
the first of them with null (nothing comes before it); and vLLM's prompt_logprobs, one map
per prompt token (null for the first) from token id to its logprob, rank and decoded_token.

Tokens are named by their text, or with vLLM's return_tokens_as_token_ids as "token_id:N":
a completions top_logprobs map is keyed by the name, so two tokens whose texts are the same
(byte-level pieces of one character both decode to "\\ufffd") would otherwise be one key, the
second overwriting the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from duoka.serve.logprob_columns import PromptLogprobColumns
from duoka.serve.params import TokenLogprob
from duoka.serve.protocol import finite

# A token's name in the response: its text, or "token_id:N".
TokenName = Callable[[int], str]
# (token id, its entry or None) in the text's order: what completion_logprobs writes.
Tokens = list[tuple[int, TokenLogprob | None]]


def token_id_name(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids spelling of a token."""
    return f"token_id:{token_id}"


def chat_logprobs(entries: list[TokenLogprob], name: TokenName) -> list[dict]:
    """Chat's logprobs.content: one entry per generated token."""
    return [{**_chat_entry(lp.token_id, lp.logprob, name),
             "top_logprobs": [_chat_entry(t, v, name) for t, v in lp.top]} for lp in entries]


def _chat_entry(token_id: int, logprob: float, name: TokenName) -> dict:
    text = name(token_id)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def completion_logprobs(tokens: Tokens, name: TokenName, offset: int) -> dict:
    """Completions' logprobs of (token id, its entry) pairs, in the text's order; an entry of
    None (a prompt's first token) is null in token_logprobs and top_logprobs. offset: the
    first token's place in the choice's text; each next one follows the previous token's name."""
    names, values, tops, offsets = [], [], [], []
    for token_id, lp in tokens:
        text = name(token_id)
        names.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(finite(lp.logprob))
        top = {name(t): finite(v) for t, v in lp.top}
        top.setdefault(text, finite(lp.logprob))  # the token itself is always listed, as vLLM does
        tops.append(top)
    return {"tokens": names, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(prompt_ids: list[int], prompt_logprobs: Sequence[TokenLogprob | None] | None,
                    name: TokenName) -> dict:
    """completion_logprobs of an echoed prompt: from the columns when the entries came packed
    from the engine process (the same lists, without an object per entry), else entry by entry."""
    if isinstance(prompt_logprobs, PromptLogprobColumns):
        return prompt_logprobs.completion_lists(prompt_ids, name)
    return completion_logprobs(echoed(prompt_ids, prompt_logprobs), name, 0)


def joined(head: dict, tokens: Tokens, name: TokenName) -> dict:
    """head (completion_logprobs' four lists) followed by tokens' own, their offsets continuing."""
    offset = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else 0
    tail = completion_logprobs(tokens, name, offset)
    return {key: head[key] + tail[key] for key in head}


def echoed(prompt_ids: list[int], prompt_logprobs: Sequence[TokenLogprob | None] | None) -> Tokens:
    """A prompt's (token id, entry) pairs for completion_logprobs; without entries, all None."""
    entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(prompt_ids)
    return list(zip(prompt_ids, entries))


def generated(entries: list[TokenLogprob]) -> Tokens:
    return [(lp.token_id, lp) for lp in entries]


def vllm_prompt_logprobs(prompt_logprobs: Sequence[TokenLogprob | None] | None,
                         name: TokenName) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: {logprob,
    rank, decoded_token}} holding the prompt's token and the k most likely (ranks 1..k)."""
    if prompt_logprobs is None:
        return None
    out: list[dict | None] = []
    for lp in prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        step = {str(t): {"logprob": finite(v), "rank": rank, "decoded_token": name(t)}
                for rank, (t, v) in enumerate(lp.top, start=1)}
        step.setdefault(str(lp.token_id), {"logprob": finite(lp.logprob), "rank": lp.rank,
                                           "decoded_token": name(lp.token_id)})
        out.append(step)
    return out
