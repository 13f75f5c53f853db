"""Supervised fine-tuning data: chat conversations rendered with the model's chat template,
the loss on the assistant's turns only, short conversations packed into windows.

Input: JSONL (or .jsonl.gz) with one conversation per line, `{"messages": [{"role": ...,
"content": ...}, ...]}`; a line that is not UTF-8 or JSON, or a message with an unknown
role (a misspelling) or without string content, is an error naming file:line. Each
conversation is rendered with the tokenizer's chat template and tokenized; a token is a
target when its characters lie in an assistant turn: the spans come from the template's
`{% generation %}` blocks where it has them, otherwise from rendering the conversation up
to each assistant turn (ChatML templates such as Qwen2's render every prefix as a prefix
of the whole). Conversations longer than a window are truncated or dropped
(`data.sft_overlong`), and one with no assistant token left in its window (none at all, or
cut off) is skipped, with counts reported. Whole conversations are packed first-fit into
windows of seq_len + 1 tokens, each followed by an end-of-text token that is never a
target, padding with end-of-text at the end; with `data.document_masking` no conversation
attends to another.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from duoka.data.dataset import _cache_dir, cache_key, corpus_files, end_of_text_id, iter_jsonl
from duoka.data.tokenizer import PREFIX_CHARS_PER_TOKEN
from duoka.errors import DuokaError


@dataclass
class SFTStats:
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    no_target: int = 0  # conversations with no assistant token in their first seq_len + 1 tokens
    windows: int = 0
    target_tokens: int = 0


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    text, spans = tokenizer.render_chat(messages)
    if spans:
        return text, spans
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix, _ = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        upto, _ = tokenizer.render_chat(messages[: i + 1])
        if not text.startswith(prefix) or not text.startswith(upto):
            raise DuokaError("the chat template does not render a conversation's beginning as a prefix of the whole, "
                             "so the assistant turns cannot be located",
                             "use a template with {% generation %} blocks around the assistant turns")
        spans.append((len(prefix), len(upto)))
    return text, spans


def encode_conversation(tokenizer, messages: list[dict], max_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 target flag per token; given max_tokens, a conversation far longer
    is encoded only as far as a prefix of more than that many tokens (it is cut there anyway)."""
    text, spans = assistant_spans(tokenizer, messages)
    ids, offsets = _encode_bounded(tokenizer, text, max_tokens)
    keep = [int(any(a < end and b > start for start, end in spans)) for a, b in offsets]
    return ids, keep


# Tokens past max_tokens that a prefix must give before it stands for the whole text: its last
# few tokens may differ from the whole text's, where the prefix was cut.
PREFIX_MARGIN = 8


def _encode_bounded(tokenizer, text: str, max_tokens: int | None) -> tuple[list[int], list]:
    """encode_with_offsets of `text`, or of a prefix cut before a space when that already holds
    more than max_tokens + PREFIX_MARGIN tokens: the tokenizer holds ~200 bytes a character of
    what it encodes, so a conversation of a huge line would otherwise cost gigabytes."""
    cut = (max_tokens + PREFIX_MARGIN + 2) * PREFIX_CHARS_PER_TOKEN if max_tokens is not None else len(text)
    if len(text) > cut:
        end = text.rfind(" ", 0, cut)
        if end > 0:
            ids, offsets = tokenizer.encode_with_offsets(text[:end])
            if len(ids) > max_tokens + PREFIX_MARGIN:
                return ids, offsets
    return tokenizer.encode_with_offsets(text)


# The roles chat templates know (Qwen2's ChatML, OpenAI's, Llama 3's ipython). Any other is
# refused: most likely a misspelling, it would render as a turn of no one and, never being
# "assistant", silently teach nothing.
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def _check_messages(messages, where: str, field: str) -> None:
    """Every message has a known role and string content (an assistant's may be null when it
    calls tools), else an error naming file:line and the message."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DuokaError(f"{where} has no list of messages in field {field!r}",
                         f'each line needs {{"{field}": [{{"role": "user", "content": "..."}}, ...]}} '
                         "(set data.messages_field if the field is named differently)")
    for i, m in enumerate(messages, start=1):
        role = m.get("role")
        if role not in ROLES:
            close = difflib.get_close_matches(str(role), ROLES, n=1)
            raise DuokaError(f"{where}: message {i} has role {role!r}, which no chat template knows",
                             (f"did you mean {close[0]!r}? " if close else "") + f"use one of: {', '.join(ROLES)}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and role == "assistant" and m.get("tool_calls"))):
            got = "no content" if "content" not in m else f"content of type {type(content).__name__}"
            raise DuokaError(f"{where}: message {i} ({role}) has {got}",
                             'give each message "content": "..." as a string')


def iter_conversations(path: Path, field: str):
    """(file:line, messages) per conversation; a malformed one is an error naming file:line:
    a converter's mistake repeats on every line, and a skipped conversation would go unnoticed."""
    for lineno, record in iter_jsonl(path):
        messages = record.get(field) if isinstance(record, dict) else None
        _check_messages(messages, f"{path}:{lineno}", field)
        yield f"{path}:{lineno}", messages


def prepare_sft(path: Path, tokenizer, seq_len: int, field: str = "messages", overlong: str = "truncate"):
    """Packed windows for SFT as two cached .npy files (tokens int32, targets uint8) of
    shape [windows, seq_len + 1]; returns (tokens path, stats)."""
    files = [f for f in corpus_files(path) if not f.name.endswith(".txt")]
    if not files:
        raise DuokaError(f"data.path {path} has no .jsonl files for data.mode=sft", "give JSONL conversations")
    eot = end_of_text_id(tokenizer)
    # "v2": windows no longer hold conversations without targets (older caches are rebuilt).
    stem = _cache_dir() / f"sft-{cache_key(files, tokenizer.fingerprint, field, seq_len, overlong, 'v2')}"
    tokens_path, mask_path, stats_path = (stem.with_suffix(s) for s in (".tokens.npy", ".mask.npy", ".json"))
    cached = _read_cache(tokens_path, mask_path, stats_path)
    if cached is not None:
        return tokens_path, cached

    width = seq_len + 1
    stats = SFTStats()
    windows: list[tuple[list[int], list[int]]] = []  # open windows, first-fit
    for f in files:
        for where, messages in iter_conversations(f, field):
            stats.conversations += 1
            try:
                ids, keep = encode_conversation(tokenizer, messages, width)
            except DuokaError as e:  # the template's complaint, located
                raise DuokaError(f"{where}: {e.cause}", e.fix) from None
            ids, keep = ids + [eot], keep + [0]  # the separator is never a target
            if len(ids) > width:
                if overlong == "drop":
                    stats.dropped += 1
                    continue
                stats.truncated += 1
                ids, keep = ids[:width], keep[:width]
            if not any(keep):
                # Nothing to learn from (no assistant turn, or one cut off by the window):
                # skipped, since a window of such conversations alone would make a step
                # whose loss divides by zero target tokens.
                stats.no_target += 1
                continue
            for w in windows:
                if len(w[0]) + len(ids) <= width:
                    w[0].extend(ids)
                    w[1].extend(keep)
                    break
            else:
                windows.append((list(ids), list(keep)))
    if not windows:
        raise DuokaError(f"no conversation of {path} was kept ({stats.dropped} dropped as longer than {width} "
                         f"tokens, {stats.no_target} without an assistant token in their first {width})",
                         "raise training.seq_len, or set data.sft_overlong=truncate if conversations were dropped")
    tokens = np.full((len(windows), width), eot, dtype=np.int32)
    mask = np.zeros((len(windows), width), dtype=np.uint8)
    for i, (ids, keep) in enumerate(windows):
        tokens[i, : len(ids)] = ids
        mask[i, : len(keep)] = keep
    stats.windows = len(windows)
    stats.target_tokens = int(mask[:, 1:].sum())
    stem.parent.mkdir(parents=True, exist_ok=True)
    for target, array in ((tokens_path, tokens), (mask_path, mask)):
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp.npy")
        np.save(tmp, array)
        os.replace(tmp, target)
    stats_path.write_text(json.dumps(stats.__dict__))
    return tokens_path, stats


def _read_cache(tokens_path: Path, mask_path: Path, stats_path: Path) -> SFTStats | None:
    """The cached stats when all three files are there and sound, else None (rebuilt)."""
    try:
        stats = SFTStats(**json.loads(stats_path.read_text()))
        tokens, mask = np.load(tokens_path, mmap_mode="r"), np.load(mask_path, mmap_mode="r")
    except (OSError, ValueError, EOFError, TypeError):  # missing, truncated, or another version's
        return None
    return stats if tokens.ndim == 2 and tokens.shape == mask.shape and len(tokens) == stats.windows else None


class SFTWindows:
    """Item i: a [2, seq_len + 1] tensor, tokens and their 0/1 target flags."""

    def __init__(self, tokens_path: Path):
        self.tokens = np.load(tokens_path, mmap_mode="r")
        self.mask = np.load(str(tokens_path).replace(".tokens.npy", ".mask.npy"), mmap_mode="r")

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.tokens[i].astype(np.int64), self.mask[i].astype(np.int64)]))
