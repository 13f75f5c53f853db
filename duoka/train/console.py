"""Rank 0's progress lines on stderr (rich), so stdout stays free for results."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console as RichConsole
from rich.markup import escape

# The command the end of a run suggests. Sampled, not greedy: a model trained for a minute
# (the default run) repeats blank lines and "the" when greedy, but samples docstring-like words;
# the seed makes the suggestion print the same text again, and --ignore-eos keeps a sample that
# draws the end-of-text token early from ending after a word or two.
TRY_PROMPT = "Return the"  # the bundled corpus is standard-library docstrings
TRY_SAMPLING = ("--temperature", "0.8", "--seed", "1", "--ignore-eos")


def try_command(final: Path) -> str:
    """The `duoka generate` command for a run's final Hugging Face folder (a LoRA run's
    adapter folder goes on its base, which the folder names)."""
    flag = "--adapter" if (final / "adapter_config.json").is_file() else "--model"
    return shlex.join(["duoka", "generate", flag, str(final), "--prompt", TRY_PROMPT, *TRY_SAMPLING])


class Console:
    def __init__(self):
        self.out = RichConsole(stderr=True, highlight=False, soft_wrap=True)

    def print(self, text: str) -> None:
        self.out.print(text)

    def warning(self, text: str) -> None:
        """One line; `text` is shown as it is (an error message may hold rich's brackets)."""
        self.out.print(f"[bold yellow]warning[/]: {escape(text)}")

    def progress(self, r: dict, steps: int, elapsed: float, start_step: int = 0) -> None:
        eta = elapsed / max(1, r["step"] - start_step) * (steps - r["step"])
        mfu_text = f" | MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        self.out.print(f"step {r['step']:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
                       f"{r['tokens_per_s']:,.0f} tok/s{mfu_text} | {r['step_time_s']:.2f} s/step | "
                       f"ETA {duration(eta)}")

    def done(self, run_dir: Path, final: Path | None, elapsed: float) -> None:
        self.out.print(f"[bold green]done[/] in {duration(elapsed)}. Run directory: {run_dir}")
        if final is not None:
            self.out.print(f"Try it:  {try_command(final)}", markup=False)


class Silent:
    """The console of every rank but 0: says nothing."""

    def print(self, text: str) -> None:
        pass

    def warning(self, text: str) -> None:
        pass

    def progress(self, r: dict, steps: int, elapsed: float, start_step: int = 0) -> None:
        pass

    def done(self, run_dir: Path, final: Path | None, elapsed: float) -> None:
        pass


def console_for(rank: int) -> Console | Silent:
    return Console() if rank == 0 else Silent()


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
