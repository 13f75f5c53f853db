"""What a new user meets in the first hour (issue 28), the parts that need no training run:
no prototype warning from the sync-debug check, `duoka plan` at 80 columns, `duoka --help`
naming every command with when to use it, and the READMEs naming them too.
(tests/integration/test_first_hour_cli.py runs the default training and the README's commands.)"""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from duoka.cli import build_parser
from duoka.plan.hardware import Hardware
from duoka.plan.model_choice import resolve_model
from duoka.plan.ranking import make_plan
from duoka.plan.render import render
from duoka.train import step_end

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- sync debug mode


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a GPU machine, recording every set_sync_debug_mode (a CPU build has none)."""
    state = {"mode": 0, "sets": []}

    def set_mode(mode):
        import warnings

        # What PyTorch's C++ side does at the first call (TORCH_WARN_ONCE): the warning a run must not show.
        if not state["sets"]:
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations", UserWarning)
        state["mode"] = step_end.SYNC_DEBUG_MODES[mode] if isinstance(mode, str) else mode
        state["sets"].append(mode)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: state["mode"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    return state


def test_a_normal_run_never_sets_the_sync_debug_mode(fake_cuda, recwarn):
    """Without debug.check_host_syncs the trainer only ever asks for "default", the mode a
    process starts in: nothing is set, so PyTorch prints no prototype warning."""
    with step_end.sync_debug("default"):
        with step_end.sync_debug("default"):
            pass
    assert fake_cuda["sets"] == []
    assert not [w for w in recwarn if "prototype" in str(w.message)]


def test_the_host_sync_check_sets_and_restores_the_mode(fake_cuda, recwarn):
    """With the check on, "error" is set for the step and the meant waits inside it go back to
    "default" and return; the prototype notice is not shown either (the user asked for the check)."""
    with step_end.sync_debug("error"):
        assert fake_cuda["mode"] == 2
        with step_end.sync_debug("default"):
            assert fake_cuda["mode"] == 0
        assert fake_cuda["mode"] == 2
    assert fake_cuda["mode"] == 0
    assert len(fake_cuda["sets"]) == 4
    assert not [w for w in recwarn if "prototype" in str(w.message)]


# ---------------------------------------------------------------- duoka plan at 80 columns


PLANS = [  # (model, gpus, nodes, GiB per GPU, seq): data parallel, pipelines, tp + pp + hsdp, one GPU
    ("qwen2-7b", 8, 1, 80, 2048),
    ("qwen2-72b", 64, 8, 80, 2048),
    ("qwen2-72b", 32, 4, 141, 8192),
    ("qwen2-0.5b", 1, 1, 80, 2048),
]


def rendered(plan, width: int, top: int = 10) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    render(plan, console, top)
    return console.export_text()


def layout_rows(text: str) -> list[str]:
    """The lines of the ranked-layouts table below its header, up to its end."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\W*#\W+layout\b", line))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("  ... and") or not line.strip() or line.startswith(("micro:", "└", "memory per GPU")):
            break
        if set(line.strip()) <= set("─━┡╇┩"):
            continue
        rows.append(line)
    return rows


@pytest.mark.parametrize("model,gpus,nodes,memory,seq", PLANS)
def test_plan_table_at_80_columns_has_one_line_per_layout(model, gpus, nodes, memory, seq):
    plan = make_plan(resolve_model(model), Hardware(gpus, nodes, memory, "nvlink"), seq, None)
    text = rendered(plan, 80)
    rows = layout_rows(text)
    shown = plan.ranked[:10]
    assert len(rows) == len(shown), text  # a row broken over lines would add lines
    for i, (row, c) in enumerate(zip(rows, shown), 1):
        assert len(row.rstrip()) <= 80, row
        assert re.match(rf"^\s*{i}\s+{re.escape(c.layout.describe(compact=True))}\s+{c.micro_batch}\s", row), row
        assert "…" not in row, row
    header = next(line for line in text.splitlines() if re.match(r"^\W*#\W+layout\b", line))
    assert "…" not in header and len(header.rstrip()) <= 80
    assert "micro: micro-batch" in text  # the short headers are explained


def test_plan_uses_the_width_it_has():
    plan = make_plan(resolve_model("qwen2-7b"), Hardware(8, 1, 80, "nvlink"), 2048, None)
    text = rendered(plan, 200)
    assert "micro-batch" in text and "est. tok/s/GPU" in text and "micro: micro-batch" not in text
    rows = layout_rows(text)
    assert len(rows) == 10 and all(c.layout.describe() in row for row, c in zip(rows, plan.ranked))


def test_plan_command_at_80_columns(in_process, monkeypatch):
    """The real command, its width from COLUMNS as in a terminal of 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")
    proc = in_process("plan", "--model", "qwen2-7b", "--gpus", "8", "--gpu-memory", "80")
    assert proc.returncode == 0, proc.stderr
    rows = layout_rows(proc.stdout)
    assert len(rows) == 10 and all(len(row.rstrip()) <= 80 for row in rows), proc.stdout


def test_compact_layout_names():
    from duoka.plan.memory import Layout

    cases = [(Layout("fsdp", 1, 8), "fsdp 8", "fsdp8"),
             (Layout("fsdp", 2, 4, reshard_after_forward=False), "hsdp 2x4 + no reshard", "hsdp2x4+noreshard"),
             (Layout("fsdp", 1, 4, tp=2, pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
              "fsdp 4 + tp 2 + pp 2 interleaved x2", "fsdp4+tp2+pp2 interleaved×2"),
             (Layout("ddp", 2, 1, pp=4, pp_schedule="zero_bubble"), "ddp 2 + pp 4 zero bubble", "ddp2+pp4 zero-bubble"),
             (Layout(), "single GPU", "single GPU")]
    for layout, words, compact in cases:
        assert (layout.describe(), layout.describe(compact=True)) == (words, compact)


# ---------------------------------------------------------------- duoka --help and the READMEs


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name as typed, its one-line help, its parser) of every command, nested ones (bench serve) included."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((prefix + name, helps.get(name) or "", sub))
                out += subcommands(sub, prefix + name + " ")
    return out


def squeeze(text: str) -> str:
    """Without whitespace: argparse wraps help lines, at spaces and after hyphens."""
    return "".join(text.split())


def test_help_lists_every_command_with_when_to_use_it(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    top = squeeze(parser.format_help())
    commands = subcommands(parser)
    assert {"train", "generate", "serve", "plan", "monitor", "report", "bench", "bench serve"} <= {c[0] for c in commands}
    for name, help_text, _ in commands:
        assert len(help_text.split()) >= 6, f"{name}: the help line must say when to use it, not only a name"
        if " " not in name:
            assert squeeze(f"{name} {help_text}") in top, f"duoka --help lacks {name!r} with its help"
        else:
            assert squeeze(name) in top, f"duoka --help does not mention {name!r}"
            parent = dict((n, p) for n, _, p in commands)[name.rsplit(" ", 1)[0]]
            assert squeeze(help_text) in squeeze(parent.format_help()), f"duoka {name.split()[0]} --help lacks it"
    assert max(len(line) for line in parser.format_help().splitlines()) <= 80


@pytest.mark.parametrize("readme", ["README.md", "README.zh.md"])
def test_readmes_show_every_command(readme):
    text = (ROOT / readme).read_text()
    missing = [name for name, _, _ in subcommands(build_parser()) if f"duoka {name}" not in text]
    assert not missing, f"{readme} never shows: {', '.join('duoka ' + m for m in missing)}"
    for image in ("docs/images/monitor.svg", "docs/images/report.png"):
        assert image in text and (ROOT / image).is_file()


# ---------------------------------------------------------------- every flag's help, every command's example


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An option's help as `--help` prints it (the formatter adds the default where the text has none)."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def test_every_option_has_help_that_states_its_default():
    for name, _, parser in subcommands(build_parser()):
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = option_help(parser, action)
            assert text, f"duoka {name} {action.option_strings[0]} has no help text"
            if action.default not in (None, [], argparse.SUPPRESS) and not isinstance(action.default, bool):
                assert "default" in text, f"duoka {name} {action.option_strings[0]}: no default in {text!r}"
    named = {"serve": ["--port"], "export": ["--max-shard-size", "--dtype"], "generate": ["--max-new-tokens", "--top-p"],
             "bench": ["--seq", "--micro-batch", "--steps", "--warmup"], "monitor": ["--interval"]}
    parsers = {name: parser for name, _, parser in subcommands(build_parser())}
    for command, flags in named.items():
        actions = {a.option_strings[0]: a for a in parsers[command]._actions if a.option_strings}
        for flag in flags:
            text = option_help(parsers[command], actions[flag])
            assert "default" in text and len(text.split()) >= 4, f"duoka {command} {flag}: {text!r}"


def test_every_command_shows_examples_that_fit_80_columns():
    for name, _, parser in subcommands(build_parser()):
        epilog = parser.epilog or ""
        assert epilog.startswith("examples:\n"), f"duoka {name} --help shows no example"
        examples = [line.strip() for line in epilog.splitlines()[1:]]
        assert any((e + " ").startswith(f"duoka {name} ") for e in examples), (name, examples)
        assert max(len(line) for line in epilog.splitlines()) <= 80, epilog
        assert epilog.splitlines()[1] in parser.format_help()  # printed as written, not re-wrapped


@pytest.mark.parametrize("args, cause, fix", [
    (["train", "--lr=1e-3"], "unknown flag --lr", "pass config keys as --section.key=value, e.g. --optimizer.lr=1e-3"),
    (["train", "--steps", "5"], "unknown flag --steps", "e.g. --training.steps=5"),
    (["train", "--output-dir=runs/x"], "unknown flag --output-dir", "e.g. --job.output_dir=runs/x"),
    (["serve", "--prot", "8001"], "unknown flag --prot", "did you mean --port? `duoka serve --help` lists"),
    (["bench", "serve", "--concurency", "4"], "unknown flag --concurency", "did you mean --concurrency?"),
    (["trian"], "unknown command 'trian'", "did you mean train?"),
    (["export", "x", "--out", "y", "--dtype", "float8"], "invalid choice: 'float8'", "duoka export --help"),
])
def test_command_line_mistakes_are_an_error_and_a_fix(in_process, args, cause, fix):
    proc = in_process(*args)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("  fix: "), proc.stderr
    assert cause in lines[0] and fix in lines[1], proc.stderr
    assert "usage:" not in proc.stderr


@pytest.mark.parametrize("readme", ["README.md", "README.zh.md"])
def test_the_readmes_curl_names_the_model_plain_duoka_serve_serves(readme):
    """README's curl follows a bare `duoka serve`: its "model" must be the bundled model's
    served name (another name is a 404 model_not_found)."""
    from duoka.serve.engine import BUNDLED_MODEL_NAME

    lines = (ROOT / readme).read_text().splitlines()
    curls = [i for i, line in enumerate(lines) if line.startswith("curl ")]
    assert curls, f"{readme} shows no request to the server"
    for i in curls:
        assert lines[i - 1].split("#")[0].strip() == "duoka serve", lines[i - 1]
        body = " ".join(lines[i:i + 2])
        assert re.findall(r'"model": "([^"]+)"', body) == [BUNDLED_MODEL_NAME], body


# ---------------------------------------------------------------- the docs name files that exist


# duoka's wings, which docs also name without the `duoka/` prefix (`serve/config.py`); bench/
# is left out there: the repository's own bench/ folder names scripts removed since, saying so.
WINGS = sorted(p.name for p in (ROOT / "duoka").iterdir() if p.is_dir() and (p / "__init__.py").is_file()
               and p.name != "bench")


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "README.zh.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "bench").rglob("*.md"))]


def test_every_duoka_source_file_the_docs_name_exists():
    named = re.compile(r"(?<![\w./-])(?:duoka/[\w/]+\.py|`(?:" + "|".join(WINGS) + r")/[\w/]+\.py`)")
    missing = []
    for page in doc_pages():
        for match in named.findall(page.read_text()):
            path = match.strip("`")
            if not (ROOT / path).is_file() and not (ROOT / "duoka" / path).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
    assert len(doc_pages()) > 20
