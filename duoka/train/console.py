"""Rank 0's progress lines on stderr (rich), so stdout stays free for results."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console as RichConsole


class Console:
    def __init__(self):
        self.out = RichConsole(stderr=True, highlight=False, soft_wrap=True)

    def print(self, text: str) -> None:
        self.out.print(text)

    def progress(self, r: dict, steps: int, elapsed: float, start_step: int = 0) -> None:
        eta = elapsed / max(1, r["step"] - start_step) * (steps - r["step"])
        mfu_text = f" | MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        self.out.print(f"step {r['step']:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
                       f"{r['tokens_per_s']:,.0f} tok/s{mfu_text} | {r['step_time_s']:.2f} s/step | "
                       f"ETA {duration(eta)}")

    def done(self, run_dir: Path, final: Path | None, elapsed: float) -> None:
        self.out.print(f"[bold green]done[/] in {duration(elapsed)}. Run directory: {run_dir}")
        if final is not None:
            self.out.print(f"Try it:  duoka generate --model {final} --prompt \"Return the\"")


class Silent:
    """The console of every rank but 0: says nothing."""

    def print(self, text: str) -> None:
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
