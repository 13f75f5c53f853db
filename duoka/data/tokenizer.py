"""Tokenizer of a Hugging Face model folder, through the `tokenizers` library.

Gives the same ids, text and chat rendering as transformers' AutoTokenizer on the same
folder (tests/unit/test_tokenizer.py checks it), without importing transformers:
- tokenizer.json drives normalisation, pre-tokenisation, BPE and decoding;
- tokenizer_config.json (and the older special_tokens_map.json) names the special tokens;
- the chat template comes from chat_template.jinja (what transformers >= 4.50 writes) or
  else from tokenizer_config.json's chat_template, and is rendered in the same sandboxed
  jinja2 environment transformers uses (trim_blocks, lstrip_blocks, its tojson,
  raise_exception, strftime_now and the {% generation %} tag), within limits on its size,
  loops and time: a template is untrusted code (duoka.data.chat_template).
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Any

from duoka.data.chat_template import render
from duoka.errors import DuokaError
from duoka.hub import resolve_model_dir

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


# From this many characters on, text is encoded through encode_batch, which releases the GIL:
# tokenizers' encode holds it for the whole call (a 15 MB prompt stopped every other thread of
# the server, its event loop too, for ~17 s).
GIL_FREE_CHARS = 1 << 14
# Characters per token of a prefix that encode_at_most reads before the whole text: English
# averages ~4 per Qwen2 token, so a text that needs more tokens than allowed within 16
# characters per token is found without reading the rest.
PREFIX_CHARS_PER_TOKEN = 16


# Rows of a model's embedding beyond its tokenizer's ids that are padding, not a mismatch: models
# round their vocabulary up for fast matmuls and room for added tokens (Qwen2's 151,936 rows hold
# 151,665 ids, 7B's 152,064). A gap within this, or within 1% of the rows, draws no warning.
VOCAB_PADDING = 1024
# A conversation every chat template renders: a template that fails on it is refused at load.
TEST_CONVERSATION = ({"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! How can I help?"},
                     {"role": "user", "content": "Say something."})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """transformers passes a message's reasoning under each name templates read."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", "lstrip": false, ...}
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = Path(folder)
        tok_file = self.folder / "tokenizer.json"
        if not tok_file.is_file():
            have = sorted(p.name for p in self.folder.glob("*")) if self.folder.is_dir() else []
            raise DuokaError(
                f"{self.folder} has no tokenizer.json" + (f" (found: {', '.join(have[:8])})" if have else ""),
                "copy tokenizer.json and tokenizer_config.json from the original model folder "
                "(a slow-only tokenizer can be converted once with transformers: "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))",
            )
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise DuokaError(f"{tok_file} cannot be read ({e})", "the file is damaged; copy it again from the model") from None
        self.config: dict[str, Any] = self._read_json("tokenizer_config.json")
        special_map = self._read_json("special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(self.config.get(key)) or _token_text(special_map.get(key))
            if text is not None:
                self.special_tokens[key] = text
        self.chat_template = self._find_chat_template()
        # generation_config.json may list several stop ids (Qwen2-Instruct: <|im_end|> and <|endoftext|>)
        self._generation_config = self._read_json("generation_config.json")

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self.folder / name
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DuokaError(f"{path} is not valid JSON ({e})", "restore the file from the original model") from None

    def _find_chat_template(self) -> str | None:
        jinja_file = self.folder / "chat_template.jinja"
        if jinja_file.is_file():
            self.chat_template_origin = str(jinja_file)
            return jinja_file.read_text(encoding="utf-8")
        self.chat_template_origin = f"{self.folder / 'tokenizer_config.json'}'s chat_template"
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t["name"]: t["template"] for t in template}
            return named.get("default", next(iter(named.values()), None))
        return template

    # ---- ids and text
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token (added ones included) with its id: two tokenizers with the same vocabulary
        give the same ids the same meaning (a speculative draft model must share the model's)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_strings(self, size: int) -> list[str]:
        """Id i's token as the vocabulary stores it (byte-level text for Qwen2), for ids below
        `size` (the model's vocabulary, which may be larger): "" for ids without a token and for
        special tokens, which never stand for text (a grammar engine must not spell JSON with them)."""
        out = [""] * size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i < size:
                out[i] = token
        for i, added in self._tok.get_added_tokens_decoder().items():
            if added.special and i < size:
                out[i] = ""
        return out

    def decoder_kind(self) -> tuple[str, bool]:
        """(the decoder's type, e.g. "ByteLevel", and whether a prefix space is added), read from
        tokenizer.json: how a token's stored text maps back to bytes."""
        spec = json.loads(self._tok.to_str())
        decoder = spec.get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [])] if decoder.get("type") == "Sequence" else [
            decoder.get("type")]
        kind = "ByteLevel" if "ByteLevel" in kinds else "ByteFallback" if "ByteFallback" in kinds else "Raw"
        pre = json.dumps(spec.get("pre_tokenizer") or {})
        return kind, '"add_prefix_space": true' in pre or '"prepend_scheme": "always"' in pre

    def _special_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def generation_config(self) -> dict[str, Any]:
        """The model folder's generation_config.json (sampling defaults, stop ids), or {}."""
        return dict(self._generation_config)

    def stop_ids(self) -> set[int]:
        """Ids that end a generation: the tokenizer's eos plus generation_config.json's."""
        ids = set()
        gen_eos = self._generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            ids.update(int(i) for i in gen_eos)
        if self.eos_id is not None:
            ids.add(self.eos_id)
        return ids

    def warnings(self, model_vocab_size: int) -> list[str]:
        """What is wrong with this tokenizer for a model of `model_vocab_size` rows, said at load:
        ids the model can produce that decode to nothing, an eos_token that is not a token."""
        out = []
        gap = model_vocab_size - self.vocab_size
        if gap > max(VOCAB_PADDING, model_vocab_size // 100):
            out.append(f"the tokenizer in {self.folder} has {self.vocab_size:,} ids but the model "
                       f"{model_vocab_size:,}: the {gap:,} ids above decode to empty text (a tokenizer from another "
                       "model?)")
        eos = self.special_tokens.get("eos_token")
        if eos is not None and self.eos_id is None:
            out.append(f"the eos_token {eos!r} of {self.folder / 'tokenizer_config.json'} is not in the vocabulary: "
                       "generation stops only at the eos ids of generation_config.json or config.json, a stop string "
                       "or max_tokens")
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_at_most(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int] | None:
        """The text's ids, or None when it holds more than max_tokens tokens. A long text is
        judged by a prefix first (cut after a whitespace, where a word ends: the prefix's
        tokens are then the text's own, give or take one), so an oversized prompt costs the
        work of max_tokens tokens, not of its whole length."""
        cut = (max_tokens + 2) * PREFIX_CHARS_PER_TOKEN
        if len(text) > cut:
            end = max(text.rfind(" ", 0, cut), text.rfind("\n", 0, cut))
            if end > 0 and len(self.encode(text[:end], add_special_tokens)) > max_tokens + 1:
                return None
        ids = self.encode(text, add_special_tokens)
        return ids if len(ids) <= max_tokens else None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span in `text` (no special tokens added)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # transformers >= 5 skips clean_up_tokenization_spaces for BPE models (it would
        # delete real spaces before punctuation), and Qwen2 is BPE: so no clean-up here.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def fingerprint(self) -> str:
        """Content hash of the files that decide tokenisation (used by data manifests)."""
        h = hashlib.sha256()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            path = self.folder / name
            if path.is_file():
                h.update(name.encode() + b"\0" + path.read_bytes())
        return h.hexdigest()[:16]

    # ---- chat
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render messages as transformers' `apply_chat_template` does; with tokenize the
        text is encoded without adding special tokens (the template already holds them)."""
        text, _ = self.render_chat(messages, add_generation_prompt, tools, documents, chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans inside {% generation %} blocks
        (the assistant's parts, for masking prompts out of an SFT loss)."""
        template = chat_template or self.chat_template
        if template is None:
            raise DuokaError(f"{self.folder} has no chat template (no chat_template.jinja, none in tokenizer_config.json)",
                             "use a chat/instruct model's tokenizer, or drop --chat and pass plain text")
        origin = self.chat_template_origin if chat_template is None else "the chat_template given"
        variables = {**self.special_tokens, **kwargs, "messages": [_alias_reasoning(m) for m in messages],
                     "tools": tools, "documents": documents, "add_generation_prompt": add_generation_prompt}
        return render(template, origin, variables, given=(messages, tools, documents, kwargs))

    def check_chat_template(self) -> None:
        """Refuse, with one error naming it, a chat template that does not compile or fails on
        a plain conversation: at start, not on every request. No template: nothing to check."""
        if self.chat_template is not None:
            self.render_chat(TEST_CONVERSATION, add_generation_prompt=True)


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    return Tokenizer(resolve_model_dir(name_or_path))


# ---------------------------------------------------------------- training a new tokenizer

# Qwen2's pre-tokeniser split (from its tokenizer.json): contractions, letter runs with
# one leading non-letter, single digits, punctuation runs, newlines, whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2-Instruct's chat template (ChatML).
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe_tokenizer(texts, vocab_size: int, out_dir: str | Path, chat_template: str = QWEN2_CHAT_TEMPLATE) -> Tokenizer:
    """Train a byte-level BPE with Qwen2's pipeline (NFC, its split regex, byte-level
    alphabet, ChatML special tokens) and write tokenizer.json + tokenizer_config.json
    that transformers' AutoTokenizer loads as a Qwen2 tokenizer. For small models
    trained from scratch, and for tests."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN2_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in QWEN2_SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return Tokenizer(out)
