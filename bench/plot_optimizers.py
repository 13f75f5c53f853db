"""Plot the loss curves of `bench/optimizers_7b.py --mode curves`: each optimizer's loss per
step (faint) and its moving mean (solid), and below, each curve's moving mean relative to
AdamW's.

    python bench/plot_optimizers.py bench/results/optimizer_curves.json [--out curves.png] [--window 10]

Needs matplotlib (a developer-machine tool: `pip install matplotlib`; duoka itself does not
depend on it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="optimizer loss curves -> PNG")
    p.add_argument("result", type=Path, help="JSON written by bench/optimizers_7b.py --mode curves")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: the JSON's path with .png)")
    p.add_argument("--window", type=int, default=10, help="steps in the moving mean (default 10)")
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    r = json.loads(a.result.read_text())
    curves = {f"{row['optimizer']} (lr {row['lr']:g})": row["losses"] for row in r["rows"] if row.get("losses")}
    if not curves:
        raise SystemExit(f"error: {a.result} holds no loss curve (every case skipped or failed)")
    reference = next((label for label in curves if label.startswith("adamw (")), None)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    smooth = {}
    for label, losses in curves.items():
        steps = list(range(1, len(losses) + 1))
        smooth[label] = moving_mean(losses, a.window)
        (line,) = top.plot(steps, smooth[label], label=label, linewidth=1.5)
        top.plot(steps, losses, color=line.get_color(), alpha=0.25, linewidth=0.8)
    top.set_ylabel("training loss")
    top.set_title(f"{r['model']}, seq {r['seq']}, global batch {r.get('global_batch')}, {r['steps']} steps, "
                  f"same init and data")
    top.legend()
    top.grid(alpha=0.3)
    if reference is not None:
        base = smooth[reference]
        for label, values in smooth.items():
            rel = [100 * (v - b) / b for v, b in zip(values, base)]
            bottom.plot(range(1, len(rel) + 1), rel, label=label, linewidth=1.2)
        bottom.axhline(0, color="black", linewidth=0.6)
        bottom.set_ylabel(f"vs AdamW, % ({a.window}-step means)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    out = a.out or a.result.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
