"""Structured output: requests whose text must follow a JSON schema, be a JSON object, or be a
tool call, enforced as a token mask at every step (xgrammar).

xgrammar is the grammar engine vLLM and SGLang use: it compiles a JSON schema or an EBNF
grammar against the model's vocabulary once (cached per grammar), then yields each step's
allowed tokens as a bitmask in microseconds per request from precomputed token sets, with
batched fills on several threads. Writing our own would mean a JSON-schema compiler and a
byte-level vocabulary automaton; xgrammar is maintained for exactly this.

The engine's side (LLMEngine):
- `submit(request_id, spec)` when a constrained request arrives: its grammar compiles on a
  worker thread; the request waits outside the scheduler until `ready` says so;
- `fill(rows)` after the step's forward is queued and before sampling: the constrained rows'
  bitmasks (sampling.TokenMasks), computed on the host while the device runs the forward;
- `accept(request_id, token)` for each sampled token: advances the request's matcher and says
  whether the grammar has ended (the request then stops);
- `drop(request_id)` when the request ends.

JSON is generated compact (any_whitespace=False: `{"a": 1}`), so a model cannot spend its
tokens on whitespace the schema allows; a schema's properties come in their given order.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from duoka.errors import DuokaError
from duoka.serve.params import StructuredOutput
from duoka.serve.sampling import TokenMasks
from duoka.serve.tool_calls import TOOL_CALL_PREFIX, TOOL_CALL_SUFFIX

# Threads that fill bitmasks (at most the machine's cores): a JSON mask takes tens of
# microseconds per request, so a step of 256 constrained rows is milliseconds on one thread.
FILL_THREADS = min(4, os.cpu_count() or 1)


def _xgrammar():
    import xgrammar  # ~2 s to import: only when a request asks for structured output

    return xgrammar


def _source(xgr, spec: StructuredOutput):
    """The xgrammar Grammar of `spec` (no vocabulary yet). Raises DuokaError when invalid."""
    try:
        if spec.kind == "json_object":  # any object: not strict, or only {} would be allowed
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "tool_call":
            return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_PREFIX)}"),
                                      xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False),
                                      xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_SUFFIX)}"))
        return xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for a schema or grammar it cannot take
        what = spec.name or spec.kind
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DuokaError(f"the {what} grammar cannot be compiled: {first[:300]}",
                         "give a valid JSON schema (docs/serving.md lists what structured output supports)") from None


def check_spec(spec: StructuredOutput) -> None:
    """Refuse a schema or grammar the engine could not compile (the API's 400), without the
    vocabulary: cheap, and in the server's process."""
    _source(_xgrammar(), spec)


@dataclass
class _Entry:
    future: Future
    matcher: object | None = None  # xgrammar.GrammarMatcher once compiled


class GrammarRows:
    """The constrained requests of one engine, and their matchers. Built lazily: xgrammar is
    imported and the vocabulary read on a worker thread at the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int]):
        self.tokenizer = tokenizer
        # The masks cover the tokenizer's ids only: the sampler disallows the logits past them
        # (Qwen2: 151,936 logits for 151,665 tokens). xgrammar handles ids past its vocabulary as
        # special, one by one at every fill: with the bundled 4,096-token tokenizer under a 152k
        # head that made a mask of 64 JSON rows 14.5 ms instead of 0.6 ms (2 cores).
        self.mask_size = min(vocab_size, tokenizer.vocab_size)
        self.stop_ids = sorted(stop_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duoka-grammar")
        self._compiler: Future | None = None
        self._entries: dict[str, _Entry] = {}
        self._batch = None
        self._bits: torch.Tensor | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __bool__(self) -> bool:
        return bool(self._entries)

    # ---------------------------------------------------------------- compiling
    def _make_compiler(self):
        xgr = _xgrammar()
        kind, prefix_space = self.tokenizer.decoder_kind()
        vocab_type = {"ByteLevel": xgr.VocabType.BYTE_LEVEL, "ByteFallback": xgr.VocabType.BYTE_FALLBACK}.get(
            kind, xgr.VocabType.RAW)
        strings = self.tokenizer.token_strings(self.mask_size)
        info = xgr.TokenizerInfo(strings, vocab_type, vocab_size=self.mask_size, stop_token_ids=self.stop_ids or None,
                                 add_prefix_space=prefix_space)
        return xgr, xgr.GrammarCompiler(info, max_threads=FILL_THREADS)

    def _compile(self, spec: StructuredOutput):
        xgr, compiler = self._compiler.result()
        return xgr.GrammarMatcher(compiler.compile_grammar(_source(xgr, spec)))

    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        """Start compiling `spec` for the request (cached per grammar by xgrammar)."""
        if self._compiler is None:
            self._compiler = self._pool.submit(self._make_compiler)
        self._entries[request_id] = _Entry(self._pool.submit(self._compile, spec))

    def ready(self, request_id: str) -> bool:
        """Whether the request's grammar has compiled (a failure raises it, as DuokaError)."""
        entry = self._entries[request_id]
        if entry.matcher is None:
            if not entry.future.done():
                return False
            entry.matcher = entry.future.result()
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until some pending grammar is compiled, or timeout_s: an engine with nothing
        else to do waits here rather than spinning."""
        pending = [e.future for e in self._entries.values() if e.matcher is None and not e.future.done()]
        if pending:
            from concurrent.futures import FIRST_COMPLETED, wait
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ---------------------------------------------------------------- steps
    def fill(self, rows: list[tuple[int, str]]) -> TokenMasks | None:
        """The bitmasks of the constrained rows among `rows` ((logits row, request id) pairs)."""
        entries = self._entries
        # A grammar that has ended has nothing to allow: its request is finishing.
        chosen = [(row, entries[rid].matcher) for row, rid in rows
                  if rid in entries and not entries[rid].matcher.is_terminated()]
        if not chosen:
            return None
        xgr = self._compiler.result()[0]
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(FILL_THREADS)
        if self._bits is None or self._bits.shape[0] < len(chosen):
            self._bits = xgr.allocate_token_bitmask(max(len(chosen), 64), self.mask_size)
        bits = self._bits[:len(chosen)]
        self._batch.batch_fill_next_token_bitmask([m for _, m in chosen], bits)
        # A copy: the sampler uploads it without blocking, and the next step refills the buffer.
        return TokenMasks([row for row, _ in chosen], bits.clone())

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's grammar by `token`; True when the grammar has ended (its stop
        token accepted) or cannot go on, so the request must stop."""
        matcher = self._entries[request_id].matcher
        if not matcher.accept_token(token):
            return True  # only when the mask left no token at all; the request ends rather than drift
        return matcher.is_terminated()

    def drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.matcher is None:
            entry.future.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
