"""Tool calls in Qwen2's Hermes format (duoka.serve.tool_calls): the whole-output parser, the
stream parser against it at every split, the schema that forces a call, and the chat history
through Qwen2.5's own template (duoka's sandbox against transformers)."""

from __future__ import annotations

import json
import random
import re

import pytest

from duoka.serve.tool_calls import (
    TOOL_CALL_PREFIX,
    TOOL_CALL_SUFFIX,
    Delta,
    ToolCallStream,
    ToolSpecError,
    parse_tool_calls,
    template_messages,
    tool_choice_schema,
    validate_tools,
)

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def block(body: str, before: str = "\n", after: str = "\n") -> str:
    return f"<tool_call>{before}{body}{after}</tool_call>"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TRICKY_ARGS = ('{"q": "a } ] { [ \\" \\\\ </tool_call> <tool_call>", "n": [1, -2.5e3, true, null, {}],'
               ' "u": "\\u00e9\u4e2d\U0001f642"}')

# (text, [(name, arguments)], content) for outputs that are calls.
WELL_FORMED = [
    (block(WEATHER), [("get_weather", '{"city": "Paris"}')], None),
    ("Let me check.\n" + block(WEATHER), [("get_weather", '{"city": "Paris"}')], "Let me check."),
    ("  Hi there  \n\n" + block(WEATHER) + "\n", [("get_weather", '{"city": "Paris"}')], "  Hi there"),
    (" \n " + block(WEATHER), [("get_weather", '{"city": "Paris"}')], None),
    (block(WEATHER) + "\n" + block('{"name": "b", "arguments": {}}'), [("get_weather", '{"city": "Paris"}'), ("b", "{}")],
     None),
    (block(WEATHER, "", "") + block(WEATHER, " \t", "\r\n") + " \n\n ", [("get_weather", '{"city": "Paris"}')] * 2,
     None),
    (block('{"name":"f","arguments":{"a":{"b":[1,2,{"c":"}"}]}}}'), [("f", '{"a":{"b":[1,2,{"c":"}"}]}}')], None),
    (block('{\n  "arguments": {"x": 1},\n  "name": "late"\n}'), [("late", '{"x": 1}')], None),
    (block('{"name": "s", "arguments": "{\\"city\\": \\"Paris\\"}"}'), [("s", '{"city": "Paris"}')], None),
    (block('{"arguments": " {} ", "name": "s2"}'), [("s2", " {} ")], None),
    (block(f'{{"name": "t", "arguments": {TRICKY_ARGS}}}'), [("t", TRICKY_ARGS)], None),
    (block('{"name": "e", "id": 7, "x": [true, null, -0.5], "arguments": {}, "y": "z"}'), [("e", "{}")], None),
    (block('{"n\\u0061me": "esc", "arguments": {}}'), [("esc", "{}")], None),
    ("Text <tool and < more\n" + block('{ "name" : "w" , "arguments" : { } }'), [("w", "{ }")],
     "Text <tool and < more"),
    ("中文 🙂\n" + block('{"name": "u", "arguments": {"城市": "巴黎"}}'), [("u", '{"城市": "巴黎"}')], "中文 🙂"),
]

MALFORMED = [
    "",
    "Just an answer.",
    "  spaces around  \n",
    "a <tool_ b <tool_call c",
    "<tool_call",
    "ends with <tool_c",
    "x </tool_call> y",
    "<tool_call>",
    "<tool_call>\n" + WEATHER + "\n<tool_call>\n" + WEATHER + "\n</tool_call>",  # the first block never closes
    "<tool_call>\n" + WEATHER + "\n</tool_ca",
    "<tool_call>\n" + WEATHER + "\n",
    "<tool_call>\n" + WEATHER,
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": ",
    "<tool_call " + WEATHER + "</tool_call>",
    block('{"name": "f", "arguments": {"a": tru}}'),
    block('{"name": "f" "arguments": {}}'),
    block('{"name": "f", "arguments": {},}'),
    block("{'name': 'f', 'arguments': {}}"),
    block('{"name": "f", "arguments": {"a": 1}'),  # one brace short
    block('{"name": "f", "arguments": {"a": [1}}}'),
    block('{"name": "f", "arguments": {"a": NaN}}'),
    block('{"name": "f", "arguments": {"a": 1}} extra'),
    block('["f", {}]'),
    block('"f"'),
    block("42"),
    block("hello"),
    block(""),
    block('{"arguments": {}}'),
    block('{"name": 3, "arguments": {}}'),
    block('{"name": "", "arguments": {}}'),
    block('{"name": "f"}'),
    block('{"name": "f", "arguments": [1]}'),
    block('{"name": "f", "arguments": null}'),
    block('{"name": "f", "arguments": "not json"}'),
    block('{"name": "f", "arguments": "[1]"}'),
    block('{"name": "f", "name": "g", "arguments": {}}'),
    block('{"name": "f", "arguments": {}, "arguments": {"a": 1}}'),
    block(WEATHER) + " and some text after",
    block(WEATHER) + "\n" + block('{"name": "f", "arguments": {,}}'),
    block(WEATHER) + "\nThen\n" + block(WEATHER),
    "<tool_call><tool_call>\n" + WEATHER + "\n</tool_call>",
    block(WEATHER) + "</tool_call>",
    block('{"name": "deep", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"),
    "before " + block('{"name": "f", "arguments": {"s": "unterminated}}'),
]


def run_stream(pieces: list[str]) -> tuple[str, list[tuple[str, str]], ToolCallStream, list[Delta]]:
    """Feeds the pieces; returns (content, [(name, arguments)] by index, the stream, deltas),
    checking the deltas' shape on the way."""
    stream = ToolCallStream()
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    content, calls = "", {}
    for d in deltas:
        assert (d.content is None) != (d.tool_call is None)
        if d.content is not None:
            assert d.content
            content += d.content
            continue
        t = d.tool_call
        if t.id is not None:  # a call's first delta: id, name, no arguments yet
            assert t.index == len(calls) and CALL_ID.match(t.id) and t.name and t.arguments == ""
            calls[t.index] = [t.name, ""]
        else:
            assert t.index in calls and t.arguments and t.name is None
            calls[t.index][1] += t.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], stream, deltas


def check_against_whole(text: str, pieces: list[str]) -> None:
    whole = parse_tool_calls(text)
    content, calls, stream, _ = run_stream(pieces)
    if whole.tool_calls:
        assert (content or None) == whole.content, (text, pieces)
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls], (text, pieces)
        assert stream.calls == len(calls)
    elif stream.calls == 0:  # no well-formed call: everything is content, as the whole parser says
        assert content == text, (text, pieces)


# ---------------------------------------------------------------- the whole output


@pytest.mark.parametrize(("text", "calls", "content"), WELL_FORMED)
def test_well_formed_outputs(text, calls, content):
    parsed = parse_tool_calls(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    for call in parsed.tool_calls:
        assert CALL_ID.match(call.id)
        assert isinstance(json.loads(call.arguments), dict)
        assert call.to_openai() == {"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_outputs_are_plain_content(text):
    parsed = parse_tool_calls(text)
    assert parsed.content == text and parsed.tool_calls == []


# ---------------------------------------------------------------- the stream


def test_stream_sends_calls_as_they_come():
    stream = ToolCallStream()
    assert stream.feed("Let me ") == [Delta(content="Let me")]  # whitespace waits: a call may follow
    assert stream.feed("check.\n<tool") == [Delta(content=" check.")]  # so do the newline and the tag's start
    assert stream.feed('_call>\n{"name": "get_wea') == []
    first = stream.feed('ther", "arguments": {"ci')
    assert [d.to_openai() for d in first[1:]] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    head = first[0].to_openai()["tool_calls"][0]
    assert CALL_ID.match(head.pop("id"))
    assert head == {"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert [d.tool_call.arguments for d in stream.feed('ty": "Paris"}}\n</tool_')] == ['ty": "Paris"}']
    assert stream.feed("call>\n") == [] and stream.calls == 1
    assert stream.finish() == []


def test_stream_holds_back_only_a_possible_tag():
    stream = ToolCallStream()
    assert stream.feed("a <tool_c") == [Delta(content="a")]
    assert stream.feed("at") == [Delta(content=" <tool_cat")]
    assert stream.feed(" trailing  ") == [Delta(content=" trailing")]
    assert stream.finish() == [Delta(content="  ")]  # no call came: the held whitespace is content
    assert stream.calls == 0


def test_stream_malformed_block_becomes_content():
    stream = ToolCallStream()
    out = stream.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu')
    out += stream.feed('ments": {"b": t')
    out += stream.feed('ru}}\n</tool_call> tail')
    out += stream.finish()
    content = "".join(d.content for d in out if d.content)
    assert content == '\n<tool_call>\n{"name": "g", "arguments": {"b": tru}}\n</tool_call> tail'
    assert [d.tool_call.index for d in out if d.tool_call] == [0, 0, 1, 1]  # call 1 began, then broke
    assert stream.calls == 1  # finish_reason "tool_calls": one well-formed call went out


@pytest.mark.parametrize("text", [t for t, _, _ in WELL_FORMED] + MALFORMED)
def test_stream_matches_whole_at_every_split(text):
    if len(text) > 2000:  # the deeply nested one: a few splits are enough
        splits = range(0, len(text), 997)
    else:
        splits = range(len(text) + 1)
    for cut in splits:
        check_against_whole(text, [text[:cut], text[cut:]])
    check_against_whole(text, list(text))  # one character at a time


PIECES = ["Sure", " ", "\n", "  ", "<tool_call>", "</tool_call>", "<tool", "_call", "<", "{", "}", '"', "text",
          "中文🙂", '{"name": "f", "arguments": {}}', "\\", ":", ","]


def fuzz_text(rng: random.Random) -> str:
    """A random output: maybe text, then calls (mostly good; some broken or half-written)
    between whitespace, maybe more text or random pieces after them."""
    calls = [WEATHER, '{"name": "g", "arguments": {"x": [1, {"y": "}"}]}}', '{"arguments": "{}", "name": "h"}',
             f'{{"name": "t", "arguments": {TRICKY_ARGS}}}', '{"name": "f", "arguments": {"a": tru}}', '{"name": "f"}']

    def junk() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 5)))

    parts = [junk()] if rng.random() < 0.4 else []
    for _ in range(rng.randint(0, 3)):
        body = rng.choice(calls[:4]) if rng.random() < 0.85 else rng.choice(calls)
        if rng.random() < 0.1:
            body = body[:rng.randint(0, len(body))]
        parts.append(rng.choice(["\n", "", " \n "]))
        parts.append(block(body, rng.choice(["\n", "", " "]), rng.choice(["\n", "", "\t"])))
    if rng.random() < 0.2:
        parts.append(junk())
    return "".join(parts)


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stream_fuzz_against_whole():
    rng = random.Random(1234)
    seen_calls = seen_plain = 0
    for _ in range(800):
        text = fuzz_text(rng)
        seen_calls += bool(parse_tool_calls(text).tool_calls)
        seen_plain += not parse_tool_calls(text).tool_calls
        for _ in range(3):
            check_against_whole(text, random_split(rng, text))
    assert seen_calls > 250 and seen_plain > 250  # both kinds were exercised


# ---------------------------------------------------------------- tool_choice


def tool(name, parameters=None, **extra):
    function = {"name": name, "description": f"{name} things", **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
TOOLS = [tool("get_weather", WEATHER_PARAMS), tool("no-params_1")]


def test_required_schema_accepts_calls_to_any_tool():
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_choice_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "no-params_1", "arguments": {}}]
    bad = [{"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}},
           {"name": "no-params_1", "arguments": {"x": 1}}, {"name": "get_weather"},
           {"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1}, {"arguments": {}},
           {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    for call in good:
        jsonschema.validate(call, schema)
    for call in bad:
        assert not jsonschema.Draft202012Validator(schema).is_valid(call), call
    assert TOOL_CALL_PREFIX == "<tool_call>\n" and TOOL_CALL_SUFFIX == "\n</tool_call>"
    forced = TOOL_CALL_PREFIX + json.dumps(good[0]) + TOOL_CALL_SUFFIX  # what the grammar lets through parses
    assert [(c.name, c.arguments) for c in parse_tool_calls(forced).tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_named_schema_allows_that_tool_only():
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["required"] == ["name", "arguments"] and schema["additionalProperties"] is False
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid({"name": "no-params_1", "arguments": {}})


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_auto_and_none_force_nothing(choice):
    assert tool_choice_schema(TOOLS, choice) is None
    assert tool_choice_schema(None, choice) is None


def test_shared_definitions_move_to_the_root():
    jsonschema = pytest.importorskip("jsonschema")
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
              "$defs": {"Point": point}}
    schema = tool_choice_schema([tool("move", params), tool("stay", {**params})], "required")
    assert schema["$defs"] == {"Point": point}
    jsonschema.validate({"name": "move", "arguments": {"at": {"x": 1}}}, schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid({"name": "move", "arguments": {"at": {"y": 1}}})
    clash = {**params, "$defs": {"Point": {"type": "string"}}}
    with pytest.raises(ToolSpecError, match=r"\$defs.Point"):
        tool_choice_schema([tool("move", params), tool("jump", clash)], "required")


def test_schemas_compile_in_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    for choice in ("required", {"type": "function", "function": {"name": "move"}}):
        schema = tool_choice_schema([*TOOLS, tool("move", params)], choice)
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


@pytest.mark.parametrize(("tools", "choice", "param", "words"), [
    (None, "required", "tool_choice", "needs tools"),
    ([], "required", "tool_choice", "needs tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "not in tools"),
    (None, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "not in tools"),
    (TOOLS, "any", "tool_choice", '"required"'),
    (TOOLS, {"type": "function", "name": "get_weather"}, "tool_choice", '"function"'),
    (TOOLS, {"function": {"name": "get_weather"}}, "tool_choice", '"function"'),
    ({"type": "function"}, "auto", "tools", "list"),
    ([{"type": "code", "function": {"name": "f"}}], "auto", "tools.0", '"type": "function"'),
    ([{"name": "f"}], "auto", "tools.0", '"type": "function"'),
    ([tool("get weather")], "auto", "tools.0.function.name", "letters, digits"),
    ([tool("x" * 65)], "auto", "tools.0.function.name", "1 to 64"),
    ([{"type": "function", "function": {"description": "d"}}], "auto", "tools.0.function.name", "valid function name"),
    ([tool("a"), tool("b"), tool("a")], "auto", "tools.2.function.name", "repeats tools.0"),
    ([tool("a", {"type": "array"})], "auto", "tools.0.function.parameters", "object"),
    ([tool("a", ["x"])], "auto", "tools.0.function.parameters", "leave it out"),
    ([tool("a", parameter={})], "auto", "tools.0.function.parameter", "unknown field"),
    ([tool("a", description=3)], "auto", "tools.0.function.description", "string"),
    ([tool("a", strict="yes")], "auto", "tools.0.function.strict", "true or false"),
])
def test_bad_tools_and_choices(tools, choice, param, words):
    with pytest.raises(ToolSpecError) as e:
        tool_choice_schema(tools, choice)
    assert isinstance(e.value, ValueError)
    assert e.value.param == param and words in e.value.message and param.split(".")[0] in e.value.message


def test_validate_tools_returns_the_functions():
    assert [f["name"] for f in validate_tools(TOOLS)] == ["get_weather", "no-params_1"]
    assert validate_tools(None) == []


# ---------------------------------------------------------------- the chat template

CONVERSATION = [
    {"role": "system", "content": "You check the weather."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "snow <b>&</b>"},
    {"role": "assistant", "content": "Paris is warm; Oslo has snow."},
    {"role": "user", "content": "Thanks!"},
]

EXPECTED_TURNS = (
    '<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n'
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
    '<tool_response>\nsnow <b>&</b>\n</tool_response><|im_end|>\n'
    '<|im_start|>assistant\nParis is warm; Oslo has snow.<|im_end|>\n'
    '<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n'
)


def test_template_messages_parse_arguments():
    converted = template_messages(CONVERSATION)
    assert converted[2]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    assert converted[2]["tool_calls"][0]["id"] == "call_1"
    assert converted[3] == CONVERSATION[3] and converted[3] is not CONVERSATION[3]
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched
    as_dict = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]
    assert template_messages(as_dict) == as_dict


WEATHER_CALL = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(("arguments", "words"), [("{bad", "not valid JSON"), ("[1]", "JSON object"),
                                                  ("NaN", "not valid JSON"), (None, "JSON object")])
def test_template_messages_bad_arguments(arguments, words):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None,
                 "tool_calls": [WEATHER_CALL, {"id": "c", "type": "function",
                                               "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(ToolSpecError, match=words) as e:
        template_messages(messages)
    assert e.value.param == "messages.1.tool_calls.1.function.arguments" and e.value.param in e.value.message


def test_template_messages_bad_calls():
    with pytest.raises(ToolSpecError) as e:
        template_messages([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}])
    assert e.value.param == "messages.0.tool_calls.0"
    with pytest.raises(ToolSpecError) as e:
        template_messages([{"role": "assistant", "tool_calls": {"id": "c"}}])
    assert e.value.param == "messages.0.tool_calls"


def test_qwen25_template_renders_tools_calls_and_results(qwen25_tokenizer_dir):
    from transformers import AutoTokenizer

    from duoka.data.tokenizer import Tokenizer

    ours, theirs = Tokenizer(qwen25_tokenizer_dir), AutoTokenizer.from_pretrained(qwen25_tokenizer_dir)
    messages = template_messages(CONVERSATION)
    text = ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == theirs.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True) == list(
        theirs.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                   return_dict=False))
    system = ("<|im_start|>system\nYou check the weather.\n\n# Tools\n\nYou may call one or more functions to assist "
              "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
              "<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS) + "\n</tools>\n\n"
              "For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call><|im_end|>\n")
    assert text == system + EXPECTED_TURNS
    # What the template shows the model as its own calls is what the parser reads back.
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(turn).tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert parse_tool_calls(turn).content is None


def test_qwen25_template_without_tools_is_plain_chatml(qwen25_tokenizer_dir):
    from duoka.data.tokenizer import Tokenizer

    text = Tokenizer(qwen25_tokenizer_dir).apply_chat_template([{"role": "user", "content": "Hi"}],
                                                               add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
