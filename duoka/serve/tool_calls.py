"""Tool calls in Qwen2's Hermes format: parsing the model's output, streaming it, the schema
that forces a call, and the chat history as Qwen2's template reads it.

Qwen2.5's chat template lists the tools in the system prompt and asks for each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several, possibly after some text; tool results come back as role "tool" messages,
which the template wraps in <tool_response>...</tool_response>.

A well-formed output is: any text, then one or more blocks `<tool_call>` JSON-object
`</tool_call>` separated (and followed) by whitespace only. Each object holds exactly one
"name" (a non-empty string) and one "arguments" (an object, or a string holding the JSON of
an object); other keys are ignored. Anything else is not a tool call: the whole output is
plain content (parse_tool_calls), never an exception.

`arguments` is the JSON text of the arguments as the model wrote it (the object's own text,
or the string's value), so that a stream of argument fragments adds up to exactly it.

Pure Python: no torch, no web framework.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# What a grammar for one forced call puts around the call object's JSON (as the template's
# own example shows the model): "<tool_call>\n" + schema JSON + "\n</tool_call>".
TOOL_CALL_PREFIX = TOOL_CALL_OPEN + "\n"
TOOL_CALL_SUFFIX = "\n" + TOOL_CALL_CLOSE

_JSON_WS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\]')
# OpenAI's rule for function names.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex characters, as OpenAI's ids look
    name: str
    arguments: str  # the arguments object as JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of call `index`: the first carries id and name (and arguments ""), later ones
    a fragment of the arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass(frozen=True)
class Delta:
    """One stream event: either content text or a piece of a tool call."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def to_openai(self) -> dict[str, Any]:
        """The `delta` object of a chat.completion.chunk."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.to_openai()]}
        return {"content": self.content}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------- one JSON object, read incrementally


class _ObjectScanner:
    """Reads one JSON object from its "{", chunk by chunk: where it ends, and where each
    top-level member's value lies in its text. Only the top level's shape (keys, colons,
    commas) and bracket nesting are checked as it goes, so a broken call is found early;
    full validity is json.loads' job once the object has ended."""

    def __init__(self) -> None:
        self.length = 0  # characters read
        self._chunks: list[str] = []  # the text read, as it came (one string per push: no copying)
        self.done = False  # its closing brace was read
        self.failed = False  # it broke JSON's shape: it cannot become a valid object
        self.members: list[tuple[str, int, int]] = []  # (key as JSON text, value start, value end)
        self.value_key: str | None = None  # key of the top-level value being read, if any
        self.value_start = -1
        self.value_opener = ""  # its first character
        self._state = "open"
        self._key = ""
        self._key_start = -1
        self._stack: list[str] = []  # closers owed inside a nested value
        self._in_string = False
        self._escape = False

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def slice(self, start: int, end: int) -> str:
        """text[start:end], without joining the chunks when it lies in the last one (the
        newest arguments text, read at every push)."""
        last = self._chunks[-1] if self._chunks else ""
        offset = self.length - len(last)
        return last[start - offset:end - offset] if start >= offset else self.text[start:end]

    def push(self, chunk: str) -> int:
        """Read `chunk` up to the object's end; returns how many of its characters belong to
        the object (all, unless it ended or broke inside; a breaking character is not taken).
        Positions inside are the chunk's; self.length + i is i's place in the object's text."""
        i = 0
        while i < len(chunk) and not (self.done or self.failed):
            i = self._read_string(chunk, i) if self._in_string else self._step(chunk, i)
        if i:
            self._chunks.append(chunk[:i])
            self.length += i
        return i

    def _read_string(self, text: str, i: int) -> int:
        if self._escape:  # the character after a backslash never ends the string
            self._escape = False
            return i + 1
        m = _STRING_STOP.search(text, i)
        if m is None:
            return len(text)
        j = m.start()
        if text[j] == "\\":
            self._escape = True
            return j + 1
        self._in_string = False
        if self._state == "key":
            start = self._key_start - self.length
            key = text[start:j + 1] if start >= 0 else self.text[start:] + text[:j + 1]
            self._key, self._state = key, "colon"
        elif self._state == "string":
            self._end_value(self.length + j + 1)
        return j + 1

    def _step(self, text: str, i: int) -> int:
        ch, state = text[i], self._state
        if state == "nested":
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._stack.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if ch != self._stack.pop():
                    return self._fail(i)
                if not self._stack:
                    self._end_value(self.length + i + 1)
            return i + 1
        if state == "scalar":
            if ch in _JSON_WS or ch in ",}":
                self._end_value(self.length + i)
                return i  # the same character again, now after the value
            return self._fail(i) if ch in '"{[]:' else i + 1
        if state == "open":
            if ch != "{":
                return self._fail(i)
            self._state = "first_key"
        elif ch in _JSON_WS:
            pass
        elif state in ("first_key", "next_key"):
            if ch == '"':
                self._in_string, self._key_start, self._state = True, self.length + i, "key"
            elif ch == "}" and state == "first_key":
                self.done = True
            else:
                return self._fail(i)
        elif state == "colon":
            if ch != ":":
                return self._fail(i)
            self._state = "value"
        elif state == "value":
            return self._start_value(ch, i)
        elif ch == ",":  # state "after": a value was read
            self._state = "next_key"
        elif ch == "}":
            self.done = True
        else:
            return self._fail(i)
        return i + 1

    def _start_value(self, ch: str, i: int) -> int:
        if ch in "}],:":
            return self._fail(i)
        self.value_key, self.value_start, self.value_opener = self._key, self.length + i, ch
        if ch == '"':
            self._in_string, self._state = True, "string"
        elif ch in "{[":
            self._stack, self._state = ["}" if ch == "{" else "]"], "nested"
        else:
            self._state = "scalar"
        return i + 1

    def _end_value(self, end: int) -> None:  # end: a place in the object's text
        self.members.append((self._key, self.value_start, end))
        self.value_key, self._state = None, "after"

    def _fail(self, i: int) -> int:
        self.failed = True
        return i


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; clients cannot


def _loads(text: str) -> Any:
    """json.loads, strict JSON only; raises ValueError (RecursionError for absurd nesting)."""
    return json.loads(text, parse_constant=_reject_constant)


def _key_name(raw: str) -> str | None:
    try:
        return _loads(raw)
    except ValueError:
        return None


def _arguments_text(raw: str) -> str | None:
    """The arguments' JSON text from the raw text of the "arguments" value: the object's own
    text, or the value of a string that holds the JSON of an object; None otherwise."""
    try:
        value = _loads(raw)
        if isinstance(value, dict):
            return raw
        return value if isinstance(value, str) and isinstance(_loads(value), dict) else None
    except (ValueError, RecursionError):
        return None


def _member(scanner: _ObjectScanner, key: str) -> list[tuple[int, int]]:
    return [(start, end) for raw, start, end in scanner.members if _key_name(raw) == key]


def _call_from_object(scanner: _ObjectScanner) -> tuple[str, str] | None:
    """(name, arguments) of a finished object, or None when it is not a well-formed call."""
    try:
        obj = _loads(scanner.text)
    except (ValueError, RecursionError):
        return None
    names, args = _member(scanner, "name"), _member(scanner, "arguments")
    # One of each: with two, json.loads keeps the last, and which one the stream sent is moot.
    if len(names) != 1 or len(args) != 1 or not isinstance(obj, dict):
        return None
    name = obj["name"]
    arguments = _arguments_text(scanner.text[args[0][0]:args[0][1]])
    if not isinstance(name, str) or not name or arguments is None:
        return None
    return name, arguments


# ---------------------------------------------------------------- a whole output


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _parse_block(text: str, pos: int) -> tuple[tuple[str, str] | None, int]:
    """The call in the block whose "<tool_call>" ends at pos, and where the block ends."""
    pos = _skip_space(text, pos)
    scanner = _ObjectScanner()
    if not text.startswith("{", pos):
        return None, pos
    pos += scanner.push(text[pos:])
    if not scanner.done:
        return None, pos
    pos = _skip_space(text, pos)
    if not text.startswith(TOOL_CALL_CLOSE, pos):
        return None, pos
    return _call_from_object(scanner), pos + len(TOOL_CALL_CLOSE)


def parse_tool_calls(text: str) -> ParsedOutput:
    """The content and tool calls of a whole output. Content is the text before the first
    call, right-stripped (None if that leaves nothing); leading whitespace stays, as a stream
    cannot drop it before knowing whether a call follows. With no block, a malformed block, or
    anything but whitespace between or after the blocks, there are no calls: the whole text
    is the content."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[ToolCall] = []
    pos = start
    while pos < len(text):
        if not text.startswith(TOOL_CALL_OPEN, pos):
            return ParsedOutput(text, [])
        call, pos = _parse_block(text, pos + len(TOOL_CALL_OPEN))
        if call is None:
            return ParsedOutput(text, [])
        calls.append(ToolCall(new_call_id(), *call))
        pos = _skip_space(text, pos)
    return ParsedOutput(text[:start].rstrip() or None, calls)


# ---------------------------------------------------------------- a stream


def _partial_open_len(text: str) -> int:
    """Length of the longest end of `text` that could still grow into "<tool_call>"."""
    for k in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0


@dataclass
class _Block:
    lead_ws: str  # the whitespace dropped before "<tool_call>" (content again if the block fails)
    index: int = -1  # given with the call's first delta: indices count the calls a client saw
    raw: list[str] = field(default_factory=lambda: [TOOL_CALL_OPEN])  # the block's text read so far
    phase: str = "open"  # open (whitespace before "{") | object | close (whitespace, "</tool_call>")
    scanner: _ObjectScanner = field(default_factory=_ObjectScanner)
    tag: str = ""  # the part of "</tool_call>" matched so far
    id: str | None = None  # set once the call's first delta went out
    sent: int = 0  # how many characters of the arguments text went out


class ToolCallStream:
    """Turns the text deltas of one output into OpenAI chat-stream deltas: content, and for
    each call a first delta (index, id, type "function", name, arguments "") then fragments of
    its arguments' JSON text as the model writes them.

    Held back: whitespace (it is dropped if a call follows) and text that may be the start of
    "<tool_call>"; finish() gives back what turned out to be content. For a well-formed output
    the assembled stream equals parse_tool_calls(whole text).

    A malformed block (broken JSON, a missing key, text where "</tool_call>" belongs, the end
    of the stream inside a block, ...) is found as soon as its text shows it: the client then
    gets the block's raw text (with the whitespace before it) as content, and no more deltas
    for that call; if its first delta already went out, that call is left incomplete and its
    index is not reused. Parsing goes on after it: a later block can still be a call. So when
    no block is well-formed, the content is the whole text, exactly as parse_tool_calls says.
    Text after a well-formed call (other than whitespace) is content too, sent after it.
    Nothing here raises on any input.

    `calls` counts the well-formed calls sent: finish_reason is "tool_calls" when it is > 0.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._pending = ""  # text mode: held-back whitespace and a possible start of the tag
        self._block: _Block | None = None
        self._next_index = 0
        self._out: list[Delta] = []

    def feed(self, delta: str) -> list[Delta]:
        text = delta
        while text:
            text = self._read_text(text) if self._block is None else self._read_block(text)
        return self._take()

    def finish(self) -> list[Delta]:
        if self._block is not None:  # the stream ended inside a block
            self._abandon("")
        if self._pending and not (self.calls and self._pending.isspace()):
            self._content(self._pending)
        self._pending = ""
        return self._take()

    # ---- text between calls
    def _read_text(self, text: str) -> str:
        buf = self._pending + text
        k = buf.find(TOOL_CALL_OPEN)
        if k >= 0:
            before = buf[:k]
            body = before.rstrip()
            self._content(body)
            self._pending = ""
            self._block = _Block(lead_ws=before[len(body):])
            return buf[k + len(TOOL_CALL_OPEN):]
        held = _partial_open_len(buf)
        head = buf[:len(buf) - held]
        body = head.rstrip()
        self._content(body)
        self._pending = buf[len(body):]
        return ""

    # ---- inside <tool_call> ... </tool_call>
    def _read_block(self, text: str) -> str:
        """Reads text into the current block; returns what follows the block, if it ended."""
        b = self._block
        i = 0
        while i < len(text):
            if b.phase == "object":
                used = b.scanner.push(text[i:])
                b.raw.append(text[i:i + used])
                i += used
                self._send_progress(b)
                if b.scanner.failed:
                    return self._abandon(text[i:])
                if b.scanner.done:
                    b.phase = "close"
                continue
            ch = text[i]
            if ch.isspace() and (b.phase == "open" or not b.tag):
                b.raw.append(ch)
            elif b.phase == "open" and ch == "{":
                b.phase = "object"
                continue
            elif b.phase == "close" and TOOL_CALL_CLOSE[len(b.tag)] == ch:
                b.raw.append(ch)
                b.tag += ch
                if b.tag == TOOL_CALL_CLOSE:
                    return self._end_block(b, text[i + 1:])
            else:  # not a call; text held as a partial "</tool_call>" is read again as text
                del b.raw[len(b.raw) - len(b.tag):]  # the tag's characters came one at a time
                return self._abandon(b.tag + text[i:])
            i += 1
        return ""

    def _send_progress(self, b: _Block) -> None:
        """Sends the call's first delta once its name is known, then the arguments known so far."""
        s = b.scanner
        if b.id is None:
            names = _member(s, "name")
            name = _key_name(s.slice(*names[0])) if len(names) == 1 else None
            if not isinstance(name, str) or not name:
                return
            self._start_call(b, name)
        args = _member(s, "arguments")
        if args:  # the first "arguments" only: a second makes the call malformed anyway
            known = _arguments_text(s.slice(*args[0])) or ""
            self._send_arguments(b, known[b.sent:])
        elif s.value_opener == "{" and _key_name(s.value_key or '""') == "arguments":
            self._send_arguments(b, s.slice(s.value_start + b.sent, s.length))  # an object streams as it comes
        # (a string's value is known only once the string has ended)

    def _send_arguments(self, b: _Block, piece: str) -> None:
        """Sends the arguments' next piece. What was sent is always a prefix of the final
        arguments: an object's own text grows at its end; a string's value goes out whole."""
        if piece:
            self._out.append(Delta(tool_call=ToolCallDelta(b.index, piece)))
            b.sent += len(piece)

    def _start_call(self, b: _Block, name: str) -> None:
        b.id, b.index = new_call_id(), self._next_index
        self._next_index += 1
        self._out.append(Delta(tool_call=ToolCallDelta(b.index, "", id=b.id, name=name)))

    def _end_block(self, b: _Block, rest: str) -> str:
        call = _call_from_object(b.scanner)
        if call is None:
            return self._abandon(rest)
        name, arguments = call
        if b.id is None:
            self._start_call(b, name)
        self._send_arguments(b, arguments[b.sent:])
        self.calls += 1
        self._block = None
        return rest

    def _abandon(self, rest: str) -> str:
        """The current block is not a call: its text is content; `rest` is read as text."""
        b = self._block
        self._block = None
        self._content(b.lead_ws + "".join(b.raw))
        return rest

    # ---- output
    def _content(self, text: str) -> None:
        if text:
            self._out.append(Delta(content=text))

    def _take(self) -> list[Delta]:
        """The deltas since the last call, neighbours of one kind merged (content with content,
        fragments of one call's arguments with each other; a call's first delta stays alone)."""
        merged: list[Delta] = []
        for d in self._out:
            last = merged[-1] if merged else None
            if last is not None and d.content is not None and last.content is not None:
                merged[-1] = Delta(content=last.content + d.content)
            elif (last is not None and d.tool_call is not None and last.tool_call is not None
                  and d.tool_call.id is None and last.tool_call.id is None
                  and last.tool_call.index == d.tool_call.index):
                t = last.tool_call
                merged[-1] = Delta(tool_call=ToolCallDelta(t.index, t.arguments + d.tool_call.arguments))
            else:
                merged.append(d)
        self._out = []
        return merged


# ---------------------------------------------------------------- tools and tool_choice


class ToolSpecError(ValueError):
    """A request's tools, tool_choice or tool-call history that cannot be honoured: the
    message names the parameter and the fix; `param` is its path (for the API's 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_CHOICE_FORMS = '"none", "auto", "required" or {"type": "function", "function": {"name": "..."}}'


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    """tools[i]'s function object, checked."""
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolSpecError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                            where)
    function = tool["function"]
    unknown = sorted(set(function) - set(_FUNCTION_KEYS))
    if unknown:
        raise ToolSpecError(f"{where}.function has unknown field(s) {', '.join(unknown)}: "
                            f"the fields are {', '.join(_FUNCTION_KEYS)}", f"{where}.function.{unknown[0]}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolSpecError(f"{where}.function.name {name!r} is not a valid function name: use 1 to 64 letters, "
                            "digits, underscores or hyphens", f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise ToolSpecError(f"{where}.function.description must be a string", f"{where}.function.description")
    if not isinstance(function.get("strict", False), bool):
        raise ToolSpecError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
    params = function.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise ToolSpecError(f'{where}.function.parameters must be a JSON schema of an object ({{"type": "object", '
                            '"properties": {...}}}); leave it out for a function without parameters',
                            f"{where}.function.parameters")
    return function


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The function objects of `tools` (None: no tools), checked as OpenAI checks them."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolSpecError('tools must be a list of {"type": "function", "function": {...}} objects', "tools")
    functions: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        function = _check_tool(tool, i)
        if function["name"] in seen:
            raise ToolSpecError(f"tools.{i}.function.name {function['name']!r} repeats tools.{seen[function['name']]}'s:"
                                " give each tool its own name", f"tools.{i}.function.name")
        seen[function["name"]] = i
        functions.append(function)
    return functions


def _chosen(functions: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The functions a tool_choice forces one call among, or None when it forces none."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not functions:
            raise ToolSpecError('tool_choice "required" needs tools: list the functions the model may call in tools, '
                                "or leave tool_choice out", "tool_choice")
        return functions
    named = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(named, dict) or tool_choice.get("type") != "function" or set(tool_choice) - {"type", "function"}
            or not isinstance(named.get("name"), str)):
        raise ToolSpecError(f"tool_choice must be {_CHOICE_FORMS}", "tool_choice")
    match = [f for f in functions if f["name"] == named["name"]]
    if not match:
        have = ", ".join(f["name"] for f in functions) or "none"
        raise ToolSpecError(f"tool_choice names function {named['name']!r}, which is not in tools (tools: {have}): "
                            "name one of them, or add it to tools", "tool_choice.function.name")
    return match


_DEFS_KEYS = ("$defs", "definitions")  # where schemas keep shared parts ("definitions": drafts before 2019-09)


def _call_schema(function: dict[str, Any], defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of one call object. The parameters' $defs (and definitions) move to the
    root's, into `defs`: their "#/$defs/..." references are absolute, so nested under
    properties.arguments they would point at nothing."""
    params = dict(function.get("parameters") or {"properties": {}, "additionalProperties": False})
    params["type"] = "object"  # arguments are an object even when the schema leaves type out
    for where in _DEFS_KEYS:
        shared = params.pop(where, None) or {}
        if not isinstance(shared, dict):
            raise ToolSpecError(f"{where} in the parameters of tool {function['name']!r} must be an object of schemas",
                                "tools")
        for key, schema in shared.items():
            if defs.setdefault(where, {}).setdefault(key, schema) != schema:
                raise ToolSpecError(f"two tools define {where}.{key} differently: give the definitions distinct "
                                    "names (and update their references)", "tools")
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_choice_schema(tools: Any, tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema of the call object that tool_choice forces ("required": any of the
    tools; a named function: that one), or None when it forces no call ("auto", "none",
    absent). The grammar is TOOL_CALL_PREFIX + this schema + TOOL_CALL_SUFFIX. Checks tools
    and tool_choice; raises ToolSpecError."""
    chosen = _chosen(validate_tools(tools), tool_choice)
    if chosen is None:
        return None
    defs: dict[str, dict[str, Any]] = {}
    calls = [_call_schema(f, defs) for f in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, **{k: v for k, v in defs.items() if v}}


# ---------------------------------------------------------------- history for the chat template


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolSpecError(f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                            '"arguments": "<JSON object>"}}}}', where)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except (ValueError, RecursionError) as e:
            raise ToolSpecError(f"{where}.function.arguments is not valid JSON ({e}): send the arguments the "
                                "model returned, a JSON object as a string", f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise ToolSpecError(f"{where}.function.arguments must hold a JSON object (as a string, as the API returns "
                            "it)", f"{where}.function.arguments")
    # The template writes `arguments | tojson`: an object, or it would print a quoted string.
    return {**call, "function": {**function, "arguments": arguments}}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as Qwen2's template reads them: an assistant message's tool calls
    with their arguments parsed into objects (the template renders them with tojson, as vLLM
    passes them); everything else unchanged (tool messages keep tool_call_id and content).
    Returns new dicts; raises ToolSpecError naming messages.N.tool_calls.M... when a call is
    malformed."""
    out = []
    for n, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            out.append(dict(message))
            continue
        if not isinstance(calls, list):
            raise ToolSpecError(f"messages.{n}.tool_calls must be a list of tool calls", f"messages.{n}.tool_calls")
        out.append({**message, "tool_calls": [_template_call(c, f"messages.{n}.tool_calls.{m}")
                                              for m, c in enumerate(calls)]})
    return out
