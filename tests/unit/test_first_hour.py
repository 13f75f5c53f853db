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
