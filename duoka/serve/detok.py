"""Incremental detokenization with stop strings.

A token is not a unit of text: byte-level BPE splits a character over several tokens
(most CJK characters and emoji are 3-4 bytes), and some decoders treat a sequence's first
token differently (a leading space). Text is therefore decoded over a short window of
recent ids, as vLLM's detokenize_incrementally and TGI do, and only what is new and final
is emitted: O(1) per token rather than a decode of the whole output.

Finality: the decoder turns bytes into text with lossy UTF-8 decoding, in which an
incomplete sequence at the end becomes a single U+FFFD and nothing before it changes as
bytes are appended. So all but a trailing U+FFFD is final; that one character is held
until the next token shows what it is (a completed character, or a real U+FFFD).

The window starts at the last few prompt ids, so the first output token decodes as a
continuation, exactly as inside the whole text. It is cut back to its last few ids every
so often; an incomplete character's bytes (at most 3) always lie inside what is kept.

Stop strings are searched in the held-back text plus the new text: held-back text is the
longest tail that could still grow into a stop string (at most len(longest stop) - 1
characters), and it is released as soon as it cannot.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
# Ids kept as context when the window is cut (and taken from the prompt at the start; vLLM
# takes 5). More than the 3 bytes of an incomplete UTF-8 character, with a margin for
# skipped special tokens that decode to nothing.
CONTEXT_IDS = 6
# The window is cut back to CONTEXT_IDS once it is this long: a decode per token costs at
# most WINDOW_IDS ids, and the cut's extra decode comes once per WINDOW_IDS - CONTEXT_IDS + 1
# tokens. A decode costs about a fixed call plus one id's share per id, so a short window is
# cheaper until the cuts' decodes dominate: 12 takes ~30% less time per token than 24.
WINDOW_IDS = 12


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self._window: list[int] = list(prompt_ids[-CONTEXT_IDS:])
        # Characters of decode(window) already accounted for: the prompt's text is not output,
        # including a trailing U+FFFD of a character the output may complete.
        self._done = len(self._decode(self._window))
        self._held = ""  # final text not yet emitted because it may start a stop string
        self._stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        """New output ids -> (text safe to emit, the matched stop string or None). After a
        stop string matched, the request is over: the text after it is never emitted."""
        if self._stopped:
            raise RuntimeError("push() after a stop string matched")
        window = self._window
        window.extend(token_ids)
        text = self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
        final = len(text) - 1 if text.endswith(_REPLACEMENT) else len(text)
        done = self._done
        new = text[done:final] if final > done else ""
        if final > done:
            self._done = done = final
        if len(window) > WINDOW_IDS:
            pending = len(text) - done  # 0 or 1: the trailing U+FFFD, decoded the same in the cut window
            self._window = window[-CONTEXT_IDS:]
            self._done = len(self._decode(self._window)) - pending
        if not self.stop:  # nothing is ever held back
            return new, None
        return self._stop_check(self._held + new)

    def _stop_check(self, text: str) -> tuple[str, str | None]:
        if not self.stop:
            return text, None
        # The earliest match wins (at one position, the first listed): the text before it is
        # what the request produced.
        found, at = None, len(text)
        for s in self.stop:
            i = text.find(s, 0, at + len(s) - 1)
            if i != -1 and i < at:
                found, at = s, i
        if found is not None:
            self._stopped = True
            self._held = ""
            return text[:at], found
        hold = max(self._partial_stop(text, s) for s in self.stop)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], None

    @staticmethod
    def _partial_stop(text: str, stop: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of `stop`."""
        start = max(0, len(text) - len(stop) + 1)
        while (start := text.find(stop[0], start)) != -1:
            if stop.startswith(text[start:]):
                return len(text) - start
            start += 1
        return 0

    def flush(self) -> str:
        """At the end of a request that did not stop on a stop string: the held-back text, and
        a trailing incomplete character as the decoder shows it (U+FFFD)."""
        if self._stopped:
            return ""
        text = self._decode(self._window)
        tail = self._held + text[self._done:]
        self._held, self._done = "", len(text)
        return tail
