"""Chat templates: code from a model folder, run on every chat request, so untrusted input.

A template renders as transformers renders it (the same sandboxed jinja2 environment:
trim_blocks, lstrip_blocks, its tojson, raise_exception, strftime_now, the {% generation %}
tag), within limits no template can pass (docs/reliability.md, "What untrusted input can do"):

- size: the rendered text, and every string or list built on the way (by *, +, %, ~, filters
  such as center, indent, replace, join, batch, string methods such as ljust or replace,
  {% set %} blocks and macros), at most TEMPLATE_MARKUP_CHARS plus TEMPLATE_COPIES times the
  characters it is given (messages, tools, documents). What can grow by a multiple is checked
  before it is built, so a render's memory is bounded by a small multiple of that limit;
- integers: at most MAX_INT_BITS bits (`10 ** 10 ** 10` is refused, not computed);
- loops: MAX_ITERATIONS iterations in all, range() at most MAX_RANGE items (jinja2's own);
- time: TEMPLATE_SECONDS; and a render stops when its RenderStop is set (the client left,
  the server stops).

The checks run in the sandbox's hooks (intercepted binary operators, calls, filters) and in
code added to every compiled template (each for loop, {% set %} and macro buffers, ~); a
render stops at the first check past a limit. A render never takes the event loop: the server
runs it on a worker thread, and since no single step of it can be large (the sizes are checked
before), the interpreter hands the GIL to the loop every few milliseconds as usual.
"""

from __future__ import annotations

import functools
import json
import math
import re
import string
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from duoka.errors import DuokaError

# The characters a template may add to what it is given. A chat template wraps each message
# in a few markers (ChatML: ~30 characters a turn) and states the tools once: 1 Mi characters is
# ~30,000 turns of markup, far beyond any context, yet small enough that a render's memory stays
# in the megabytes whatever the template does.
TEMPLATE_MARKUP_CHARS = 1 << 20
# How many times a template may repeat what it is given: published templates print each
# message once and the tools at most twice (as JSON and in prose).
TEMPLATE_COPIES = 4
# A render of a real template takes about a millisecond (Qwen2.5's with tools, 100 turns: 2 ms);
# 5 s is a thousand times that under any load, and the most a hostile one holds a thread.
TEMPLATE_SECONDS = 5.0
# Loop iterations of one render, all loops together: templates loop over the messages, their
# content parts and the tools, so even 100,000 turns stay far below; nested range() loops reach
# it in ~0.3 s.
MAX_ITERATIONS = 1_000_000
# range()'s longest, jinja2's sandbox's own limit (MAX_RANGE), kept as it was.
MAX_RANGE = 100_000
# Integers a template computes (counters, indices, lengths): 4096 bits is 1,233 digits.
MAX_INT_BITS = 4096
# tojson's indent: templates indent JSON by 2 or 4; a wide indent times deep nesting multiplies.
MAX_JSON_INDENT = 16
# Element copies a `sum` of lists may make (it copies the running list at every item, so its
# work grows with the square of the items): ~0.1 s.
MAX_SUM_COPIES = 10**8


class TemplateLimit(Exception):
    """A render passed one of its limits, or was stopped."""


class TemplateRefusal(jinja2.TemplateError):
    """The template's own raise_exception(): it refuses these messages (their roles, order)."""


class RenderStop:
    """Stops a render from another thread: it ends at its next check, saying `reason`."""

    def __init__(self):
        self.reason: str | None = None

    def stop(self, reason: str) -> None:
        self.reason = reason  # one assignment: atomic under the GIL


# The RenderStop of the request being handled: set around a request's work by the server (a
# worker thread started by asyncio.to_thread copies it), read by each render it starts.
request_stop: ContextVar[RenderStop | None] = ContextVar("duoka_render_stop", default=None)


class Budget:
    """One render's limits and what it has used so far."""

    def __init__(self, max_chars: int, seconds: float = math.inf, stop: RenderStop | None = None):
        self.max_chars = max_chars
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.iterations = 0
        self.stop = stop
        self.own_stop = RenderStop()  # set by stop_renders

    def tick(self) -> None:
        for stop in (self.stop, self.own_stop):
            if stop is not None and stop.reason is not None:
                raise TemplateLimit(f"the render was stopped ({stop.reason})")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"the render took longer than its limit of {self.seconds:g} s")

    def size(self, chars: int, what: str) -> None:
        if chars > self.max_chars:
            raise TemplateLimit(f"{what} would be {chars:,} characters, over the limit of {self.max_chars:,} for "
                                "this render")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_ITERATIONS:
            raise TemplateLimit(f"its loops ran more than {MAX_ITERATIONS:,} iterations")
        self.tick()


_budget: ContextVar[Budget | None] = ContextVar("duoka_render_budget", default=None)
_active: set[Budget] = set()
_active_lock = threading.Lock()


def current() -> Budget:
    """The running render's budget; outside a render (jinja2 folding constants while it
    compiles) a fresh one with the fixed limits and no deadline."""
    return _budget.get() or Budget(TEMPLATE_MARKUP_CHARS)


def stop_renders(reason: str) -> int:
    """Stop every render running now (a server stopping: none may keep the process alive);
    returns how many there were."""
    with _active_lock:
        running = list(_active)
    for budget in running:
        budget.own_stop.stop(reason)
    return len(running)


def weight(value: Any, limit: int) -> int:
    """About how many characters `value` prints as: a string its length, a list, tuple or dict
    its items' sum (plus 2 each), anything else 4. The walk stops once past `limit`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += 2
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            total += 4
    return total


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What `*` and `+` repeat or join (bytes: a template reaches them through str.encode).
_SEQUENCES = (str, bytes, list, tuple)


# ---------------------------------------------------------------- checks before an operation


def _check_binop(budget: Budget, op: str, left: Any, right: Any) -> None:
    limit = budget.max_chars
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, _SEQUENCES) and _is_int(n) and n > 1:
                budget.size(weight(seq, limit) * n, "a repeated string or list")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product of integers would pass {MAX_INT_BITS} bits")
    elif op == "**":
        if _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0 and \
                left.bit_length() * right > MAX_INT_BITS:
            raise TemplateLimit(f"a power of integers would pass {MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(left, str) and isinstance(right, str):
            if len(left) + len(right) > limit:
                budget.size(len(left) + len(right), "a concatenation")
        elif isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            budget.size(weight(left, limit) + weight(right, limit), "a concatenation")
    elif op == "%" and isinstance(left, (str, bytes)):
        _check_percent(budget, left if isinstance(left, str) else left.decode("latin-1"), right)


# printf-style conversions: their widths and precisions (literal, or * taken from the arguments)
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_percent(budget: Budget, fmt: str, args: Any) -> None:
    """str % args: its literal widths and precisions, and the integer arguments that a * takes."""
    values = args if isinstance(args, tuple) else (args,)
    stars = sum(abs(v) for v in values if _is_int(v)) if "*" in fmt else 0
    widths = sum(int(n) for m in _PERCENT.finditer(fmt) for n in m.groups() if n and n != "*")
    budget.size(len(fmt) + widths + stars + weight(values, budget.max_chars), "a %-formatted string")


def _check_format(budget: Budget, fmt: str, args: tuple, kwargs: dict) -> None:
    """str.format: the widths in its format specs, and (for a spec with a {field} in it) the
    integer arguments it may take as a width."""
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        return  # format() itself refuses it
    widths = sum(int(n) for spec in specs for n in re.findall(r"\d+", spec))
    nested = any("{" in spec for spec in specs)
    values = (*args, *kwargs.values())
    stars = sum(abs(v) for v in values if _is_int(v)) if nested else 0
    budget.size(len(fmt) + widths + stars + weight(values, budget.max_chars), "a formatted string")


def _check_replace(budget: Budget, text: str | bytes, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(old, type(text)) and isinstance(new, type(text))):
        return
    n = text.count(old) if old else len(text) + 1
    if _is_int(count) and count >= 0:
        n = min(n, count)
    budget.size(len(text) + n * max(0, len(new) - len(old)), "a replace()'s result")


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _check_str_method(budget: Budget, text: str | bytes, name: str, args: tuple, kwargs: dict) -> tuple:
    """A str (or bytes) method that can build more than it is given; returns the arguments to
    call it with (join's iterable read once, into a list)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _arg(args, kwargs, 0, "width", 0)
        if _is_int(width):
            budget.size(width, f"str.{name}()'s result")
    elif name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        if _is_int(tab):
            budget.size(len(text) + text.count(b"\t" if isinstance(text, bytes) else "\t") * max(tab, 0),
                        "str.expandtabs()'s result")
    elif name == "replace":
        _check_replace(budget, text, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                       _arg(args, kwargs, 2, "count", -1))
    elif name == "join" and args:
        items = list(args[0])
        budget.size(weight(items, budget.max_chars) + len(text) * len(items), "str.join()'s result")
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        budget.size(len(text) * longest, "str.translate()'s result")
    return args


def _check_call(budget: Budget, obj: Any, args: tuple, kwargs: dict) -> tuple:
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(owner, (str, bytes)):
        return _check_str_method(budget, owner, name, args, kwargs)
    wrapped = getattr(obj, "__wrapped__", None)  # the sandbox's wrapper of str.format / format_map
    if name in ("format", "format_map") and isinstance(getattr(wrapped, "__self__", None), str):
        if name == "format_map" and args and isinstance(args[0], dict):
            kwargs = args[0]
        _check_format(budget, wrapped.__self__, args if name == "format" else (), kwargs)
    elif obj is generate_lorem_ipsum:
        n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
        if _is_int(n) and _is_int(most):
            budget.size(n * most * 16, "lipsum()'s text")  # words of up to ~15 characters
    elif isinstance(obj, LoopContext) and args:  # a recursive loop's next level
        return (_guarded(args[0]), *args[1:])
    return args


def _check_result(budget: Budget, result: Any, what: str) -> Any:
    if isinstance(result, str):
        if len(result) > budget.max_chars:
            budget.size(len(result), what)
    elif isinstance(result, (list, tuple, dict)):
        budget.size(weight(result, budget.max_chars), what)
    return result


def _guarded(iterable: Any):
    budget = current()
    for item in iterable:
        budget.iterate()
        yield item


# ---------------------------------------------------------------- filters


def _check_filter_args(budget: Budget, name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """The filters that can build more than they are given."""
    limit = budget.max_chars
    if name == "center":
        width = _arg(args, kwargs, 0, "width", 80)
        if _is_int(width):
            budget.size(width, "the center filter's result")
    elif name == "indent":
        width = _arg(args, kwargs, 0, "width", 4)
        text = str(value)
        per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
        budget.size(len(text) + (text.count("\n") + 1) * per_line, "the indent filter's result")
    elif name == "wordwrap":
        width, wrap = _arg(args, kwargs, 0, "width", 79), _arg(args, kwargs, 2, "wrapstring") or "\n"
        text = str(value)
        if _is_int(width) and isinstance(wrap, str):
            budget.size(len(text) + (len(text) // max(width, 1) + 1) * len(wrap), "the wordwrap filter's result")
    elif name == "replace":
        _check_replace(budget, str(value), _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                       _arg(args, kwargs, 2, "count"))
    elif name == "format" and isinstance(value, str):
        _check_percent(budget, value, tuple(args) or (kwargs,))
    elif name in ("batch", "slice"):
        count, fill = _arg(args, kwargs, 0, "linecount" if name == "batch" else "slices", 1), \
            _arg(args, kwargs, 1, "fill_with")
        if _is_int(count):
            budget.size(count * max(1, weight(fill, limit) if fill is not None else 1), f"the {name} filter's result")
    elif name == "sum":
        start = _arg(args, kwargs, 1, "start", 0)
        if isinstance(start, (list, tuple, str)):
            items = value if isinstance(value, (list, tuple)) else ()
            total = weight(items, limit) + weight(start, limit)
            budget.size(total, "the sum filter's result")
            if len(items) * total > MAX_SUM_COPIES:
                raise TemplateLimit(f"a sum of {len(items):,} sequences would copy more than {MAX_SUM_COPIES:,} items")


def _guard_filter(name: str, func):
    """The filter, with its arguments checked first and its result after."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # context, eval context or environment

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        budget = current()
        budget.tick()
        if name in ("sum", "join") and len(args) > skip and not isinstance(args[skip], (list, tuple, str)):
            args = (*args[:skip], list(_guarded(args[skip])), *args[skip + 1:])  # read once, counted
        if name == "join" and len(args) > skip:
            sep = _arg(args[skip + 1:], kwargs, 0, "d", "")
            items = args[skip]
            budget.size(weight(items, budget.max_chars) + len(str(sep)) * len(items), "the join filter's result")
        if len(args) > skip:
            _check_filter_args(budget, name, args[skip], args[skip + 1:], kwargs)
        return _check_result(budget, func(*args, **kwargs), f"the {name} filter's result")

    return guarded


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which chat templates must not (transformers' rule).
    if (len(indent) if isinstance(indent, str) else indent or 0) > MAX_JSON_INDENT:
        raise TemplateLimit(f"tojson's indent is over {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _range(*args):
    try:
        r = range(*args)
        n = len(r)
    except OverflowError:
        n = math.inf
    if n > MAX_RANGE:
        raise TemplateLimit(f"range() of more than {MAX_RANGE:,} items")
    return r


# ---------------------------------------------------------------- the environment


class _CodeGenerator(CodeGenerator):
    """jinja2's code, with the checks of a render where the sandbox has no hook: each for loop
    counts its iterations, {% set %}/macro buffers and ~ count their characters."""

    def visit_For(self, node, frame):
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("guard_iteration"), [node.iter], [], None,
                                      None, lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def buffer(self, frame):
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    def visit_Concat(self, node, frame):
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {'context.eval_ctx.volatile' if frame.eval_ctx.volatile else frame.eval_ctx.autoescape})")


class _Buffer(list):
    """The output of a {% set %} block, macro or call block: refused once it passes the limit."""

    def append(self, item):
        self._grow(len(item))
        super().append(item)

    def extend(self, items):
        items = tuple(items)
        self._grow(sum(len(i) for i in items))
        super().extend(items)

    def _grow(self, chars: int) -> None:
        budget = current()
        self.chars = getattr(self, "chars", 0) + chars
        budget.size(self.chars, "a block's output")


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CodeGenerator

    def call_binop(self, context, operator, left, right):
        budget = current()  # no tick: a binary operation is quick, and what repeats it (a loop) ticks
        _check_binop(budget, operator, left, right)
        return _check_result(budget, self.binop_table[operator](left, right), f"the {operator!r} operator's result")

    def call(self, context, obj, /, *args, **kwargs):
        budget = current()
        budget.tick()
        args = _check_call(budget, obj, args, kwargs)
        return _check_result(budget, super().call(context, obj, *args, **kwargs), "a call's result")

    @staticmethod
    def guard_iteration(iterable):
        return _guarded(iterable)

    @staticmethod
    def output_buffer() -> list:
        return _Buffer()

    @staticmethod
    def concat_checked(parts: tuple, markup: bool) -> str:
        texts = [str(p) for p in parts]
        current().size(sum(len(t) for t in texts), "a ~ concatenation")
        return markup_join(parts) if markup else str_join(texts)


_generation_spans: ContextVar[tuple[list, list] | None] = ContextVar("duoka_generation_spans", default=None)


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body and records where."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", [jinja2.nodes.ContextReference()]), [], [], body
                                      ).set_lineno(lineno)

    def _render(self, context, caller):
        text = caller()
        tracking = _generation_spans.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise TemplateRefusal(message)


def _strftime_now(fmt):
    current().size(len(str(fmt)) * 16, "strftime_now()'s result")  # %c: 24 characters for 2
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters = {name: _guard_filter(name, func) for name, func in env.filters.items()}
    env.filters["tojson"] = _guard_filter("tojson", _tojson)
    env.globals["range"] = _range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    return _environment().from_string(source)


# What to do about a template that fails whatever the messages.
def fix_template(origin: str) -> str:
    return (f"the template ({origin}) is broken or hostile, not the request: replace it with the model's original "
            "chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")


def compile_template(source: str, origin: str):
    """The compiled template, or one error naming it and the line that does not compile."""
    try:
        return _compiled(source)
    except jinja2.TemplateSyntaxError as e:
        raise DuokaError(f"the chat template in {origin} does not compile: {e.message} (line {e.lineno})",
                         fix_template(origin)) from None
    except (TemplateLimit, RecursionError, MemoryError) as e:  # a constant folded while it compiles
        raise DuokaError(f"the chat template in {origin} does not compile: {e}", fix_template(origin)) from None


def _given_chars(given: Iterable[Any]) -> int:
    """The characters of what a render is given, as JSON (counted in C: a request's messages
    can be megabytes)."""
    return len(json.dumps(list(given), ensure_ascii=False, default=str))


@contextmanager
def _running(budget: Budget):
    token = _budget.set(budget)
    with _active_lock:
        _active.add(budget)
    try:
        yield
    finally:
        with _active_lock:
            _active.discard(budget)
        _budget.reset(token)


def render(source: str, origin: str, variables: dict[str, Any], given: Iterable[Any] = (),
           seconds: float = TEMPLATE_SECONDS) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its {% generation %} blocks. `given`:
    what the request hands the template (messages, tools, documents), which its size limit
    grows with. A render that fails is one DuokaError: naming the messages when the template
    refuses them (raise_exception, a missing field, a value of the wrong type), else the template."""
    compiled = compile_template(source, origin)
    budget = Budget(TEMPLATE_MARKUP_CHARS + TEMPLATE_COPIES * _given_chars(given), seconds, request_stop.get())
    spans: list[tuple[int, int]] = []
    blocks: list[str] = []
    chars = 0
    token = _generation_spans.set((blocks, spans))
    try:
        with _running(budget):
            # generate() yields output in order, so a {% generation %} block knows its start
            # from what was yielded before it (as transformers does).
            for block in compiled.generate(**variables):
                chars += len(block)
                if chars > budget.max_chars:
                    budget.size(chars, "the rendered text")
                blocks.append(block)
    except (TemplateRefusal, jinja2.UndefinedError, TypeError) as e:  # TypeError: None + str and the like
        raise DuokaError(f"the chat template rejected these messages: {e}",
                         "check the roles and their order (most templates want alternating user/assistant turns) "
                         f"and the fields each message has; the template is {origin}") from None
    except TemplateLimit as e:
        raise DuokaError(f"the chat template in {origin} was stopped: {e}", fix_template(origin)) from None
    except Exception as e:  # noqa: BLE001 - any other failure of untrusted code is the template's
        raise DuokaError(f"the chat template in {origin} failed: {type(e).__name__}: {e}", fix_template(origin)) \
            from None
    finally:
        _generation_spans.reset(token)
    return "".join(blocks), spans
