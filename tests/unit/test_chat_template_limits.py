"""A chat template is untrusted code from a model folder: whatever it does, a render ends
quickly in one DuokaError naming the template (not the messages), its memory stays bounded,
it can be stopped from another thread, and it never holds the GIL for long. Real templates
(Qwen2's, the fixtures) render exactly as before: test_tokenizer.py and test_tool_calls.py
compare them with transformers."""

from __future__ import annotations

import json
import shutil
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from duoka.data import chat_template
from duoka.data.chat_template import RenderStop, render, request_stop, stop_renders
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir

USER = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "string repeated 1e9 times": ("{{ 'x' * 10**9 }}", "a repeated string or list would be 1,000,000,000 characters"),
    "a huge power": ("{{ 7 ** (10 ** 8) }}", "a power of integers would pass 4096 bits"),
    "range(10**9)": ("{{ range(10**9)|list|length }}", "range() of more than 100,000 items"),
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           "its loops ran more than 1,000,000 iterations"),
    "doubling with ~": (("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                         "{% endfor %}{{ ns.s }}"), "a ~ concatenation would be 2,097,152 characters"),
    "doubling in a macro": (("{% macro f(s, n) %}{% if n %}{{ f(s + s, n - 1) }}{% else %}{{ s }}{% endif %}"
                             "{% endmacro %}{{ f('x', 64) }}"), "a concatenation would be 2,097,152 characters"),
    "a block of copies": (("{% set s = 'x' * 500000 %}{% set b %}{% for i in range(1000) %}{{ s }}{% endfor %}"
                           "{% endset %}{{ b }}"), "a block's output would be"),
    "output of copies": ("{% set s = 'x' * 500000 %}{% for i in range(1000) %}{{ s }}{% endfor %}",
                         "the rendered text would be"),
    "center": ("{{ 'x'|center(10**9) }}", "the center filter's result would be"),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "str.ljust()'s result would be"),
    "printf width": ("{{ '%*s' % (10**9, 'x') }}", "a %-formatted string would be"),
    "format width": ("{{ '{:{}}'.format('x', 10**9) }}", "a formatted string would be"),
    "replace": ("{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}", "a replace()'s result would be"),
    "batch fill": ("{{ [1]|batch(10**6, 'x' * 100000)|list }}", "the batch filter's result would be"),
    "indent": ("{{ ('a\\n' * 400000)|indent(1000) }}", "the indent filter's result would be"),
    "lipsum": ("{{ lipsum(10**8) }}", "lipsum()'s text would be"),
    "tojson indent": ("{{ messages|tojson(indent=10**8) }}", "tojson's indent is over 16"),
    "a list times a million": ("{{ (['x' * 1000] * 10**6)|string }}", "a repeated string or list would be"),
    "sum of lists": ("{{ range(100000)|batch(1)|sum(start=[])|length }}", "a sum of 100,000 sequences"),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed: RecursionError"),
    "division by zero": ("{{ 1 / 0 }}", "failed: ZeroDivisionError"),
    "sandbox escape": ("{{ cycler.__init__.__globals__ }}", "failed: SecurityError"),
}


@pytest.mark.parametrize("template, said", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_is_one_error_naming_it_quickly_in_bounded_memory(template, said):
    start = time.process_time()  # the render's CPU seconds: a loaded machine stretches only the wall clock's
    tracemalloc.start()  # every Python object the render makes, this test's alone
    try:
        with pytest.raises(DuokaError) as e:
            # Each template must meet the limit made for it, not the 5 s clock (its own test is
            # below): traced, the nested loops take ~3 s, and a loaded machine stretched them past 5.
            render(template, "/models/m/chat_template.jinja", {"messages": USER}, given=(USER,), seconds=600)
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    took = time.process_time() - start
    assert said in e.value.cause, e.value.cause
    assert e.value.cause.startswith("the chat template in /models/m/chat_template.jinja ")
    assert "broken or hostile" in e.value.fix and "roles" not in e.value.fix + e.value.cause
    assert took < 10.0, f"{took:.2f} s"  # traced: ~6x slower (untraced, the nested loops stop in ~0.5 s)
    assert peak_mb < 64, f"the render took {peak_mb:.0f} MB"


def test_the_size_limit_grows_with_what_the_template_is_given():
    """A 3 MB message renders (the limit is 1 Mi characters plus 4x what the template is given),
    while the same template may not make 5 copies of it."""
    big = [{"role": "user", "content": "word " * 600_000}]
    text, _ = render("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}", "T", {"messages": big},
                     given=(big,))
    assert len(text) == 6_000_000
    with pytest.raises(DuokaError, match="the rendered text would be"):
        render("{% for i in range(5) %}{{ messages[0].content }}{% endfor %}", "T", {"messages": big}, given=(big,))


# ~1 M iterations of a 20 kB string each: seconds of work within the iteration limit
SLOW = ("{% for i in range(1000) %}{% for j in range(990) %}{% set s = ('y' * 20000)|length %}"
        "{% endfor %}{% endfor %}")


def test_a_render_past_its_time_limit_stops():
    slow = SLOW.replace("990", "900")
    start = time.monotonic()
    with pytest.raises(DuokaError, match=r"took longer than its limit of 0.3 s"):
        render(slow, "T", {"messages": USER}, given=(USER,), seconds=0.3)
    assert time.monotonic() - start < 1.5


def _render_in_thread(stop: RenderStop | None = None):
    result = {}

    def run():
        token = request_stop.set(stop)
        try:
            render(SLOW, "T", {"messages": USER}, given=(USER,), seconds=30)
        except DuokaError as e:
            result["error"] = e.cause
        finally:
            request_stop.reset(token)
            result["ended"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


@pytest.mark.parametrize("how", ["its request's RenderStop", "stop_renders"])
def test_a_render_stops_at_once_when_stopped_from_another_thread(how):
    """The server sets a request's RenderStop when its client leaves, and calls stop_renders
    when it stops; meanwhile the render gives the GIL back: another thread keeps its pace."""
    stop = RenderStop()
    thread, result = _render_in_thread(stop)
    gaps, last = [], time.monotonic()
    for _ in range(20):  # 0.2 s of a thread that wants to run every 10 ms
        time.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    assert thread.is_alive()
    asked = time.monotonic()
    if how == "stop_renders":
        assert stop_renders("the server is stopping") == 1
    else:
        stop.stop("the client disconnected")
    thread.join(5)
    assert result["ended"] - asked < 0.5
    reason = "the server is stopping" if how == "stop_renders" else "the client disconnected"
    assert f"the render was stopped ({reason})" in result["error"]
    assert max(gaps) < 0.1, gaps
    assert not chat_template._active


def _tokenizer_with(tokenizer_dir, tmp_path, template: str) -> Tokenizer:
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(template)
    return Tokenizer(folder)


@pytest.mark.parametrize("template, said", [
    ("{% if messages %}{{ messages[0].content }", r"does not compile: unexpected '}' \(line 1\)"),
    ("{{ raise_exception('this template renders nothing') }}", "rejected these messages: this template renders"),
    ("{% for m in messages %}{{ m.content * 10**9 }}{% endfor %}", "was stopped: a repeated string"),
], ids=["syntax", "refuses everything", "hostile on every conversation"])
def test_a_template_that_fails_on_a_plain_conversation_is_refused_at_load(tokenizer_dir, tmp_path, template, said):
    tok = _tokenizer_with(tokenizer_dir, tmp_path, template)
    with pytest.raises(DuokaError, match=said) as e:
        tok.check_chat_template()
    assert str(tok.folder / "chat_template.jinja") in e.value.cause + e.value.fix


def test_a_template_that_refuses_a_request_names_the_messages(tokenizer_dir, tmp_path):
    """raise_exception is the template's own word on the messages: the error keeps naming them."""
    tok = _tokenizer_with(tokenizer_dir, tmp_path, "{% if messages[0].role != 'user' %}{{ raise_exception("
                                                   "'the first message must be the user') }}{% endif %}ok")
    tok.check_chat_template()
    with pytest.raises(DuokaError, match="the chat template rejected these messages: the first message must be") as e:
        tok.render_chat([{"role": "assistant", "content": "hi"}])
    assert "roles" in e.value.fix


def test_a_tokenizer_without_a_template_passes_the_load_check(tokenizer_dir, tmp_path):
    tok = _tokenizer_with(tokenizer_dir, tmp_path, "x")
    (tok.folder / "chat_template.jinja").unlink()
    Tokenizer(tok.folder).check_chat_template()


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{{ m.content }", "does not compile: unexpected '}'"),
    ("{{ range(10**9)|list }}", "was stopped: range() of more than 100,000 items"),
], ids=["syntax", "range(10**9)"])
def test_generate_chat_prints_one_error_for_a_template_that_fails(tmp_path, in_process, template, said):
    folder = Path(shutil.copytree(bundled_model_dir(), tmp_path / "model"))
    (folder / "chat_template.jinja").write_text(template)
    proc = in_process("generate", "--model", str(folder), "--chat", "--prompt", "hi", "--max-new-tokens", "2",
                      "--device", "cpu")
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr
    assert said in proc.stderr and str(folder / "chat_template.jinja") in proc.stderr, proc.stderr
