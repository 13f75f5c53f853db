"""The SSE fast path (duoka/serve/api.py): an event built from a per-request template is the
same bytes as the whole object through _sse(), for any text."""

from __future__ import annotations

import json

import pytest

from duoka.serve.api_responses import _HOLE, _encode_str, _sse, _template

TEXTS = ["", "a", " the", 'say "hi"', "back\\slash", "tab\there\nnew\r", "\x00\x1f\x7f", "\u2028\u2029",
         "é中文🙂", "\ud800", "</script>", _HOLE[:3], "{}[],:"]


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_template_events_equal_whole_object_events(chat, usage):
    base = {"id": "cmpl-0123abcd", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1700000000, "model": "mine/é \"x\""}
    if usage:
        base["usage"] = None

    def obj(text):
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return {**base, "choices": [{**choice, "logprobs": None, "finish_reason": None}]}

    before, after = _template(obj(_HOLE))
    for text in TEXTS:
        assert before + _encode_str(text) + after == _sse(obj(text))
        assert _sse(obj(text)) == f"data: {json.dumps(obj(text), ensure_ascii=False, separators=(',', ':'))}\n\n"


def test_a_name_holding_the_hole_gets_no_template():
    assert _template({"model": _HOLE, "text": _HOLE}) is None
