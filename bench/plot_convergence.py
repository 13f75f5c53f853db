"""Plot the JSON of bench/convergence.py: both loss curves, and their relative difference
step by step.

    python bench/plot_convergence.py bench/results/convergence.json [--out convergence.png]

Needs matplotlib (a developer-machine tool: `pip install matplotlib`; duoka itself does not
depend on it).

It draws docs/performance.md's loss plots, bench/results/convergence.png and
convergence_float8.png, from bench/convergence.py's JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="loss curves of duoka and the transformers peer -> PNG")
    p.add_argument("result", type=Path, help="JSON written by bench/convergence.py")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: the JSON's path with .png)")
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    r = json.loads(a.result.read_text())
    duoka, peer = r["duoka"], r["peer"]
    steps = list(range(1, len(duoka) + 1))
    # Per step, signed and relative to the peer, in percent: noise scatters around zero, a
    # systematic difference shows as an offset. The summary figure is over the last window.
    rel = [100 * (d - q) / abs(q) if q else float("nan") for d, q in zip(duoka, peer)]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    top.plot(steps, duoka, label="duoka train", linewidth=1.4)
    top.plot(steps, peer, label=f"transformers peer{' (compiled layers)' if r.get('peer_compile') else ''}",
             linewidth=1.4, linestyle="--")
    window = r.get("final_window", 10)
    if len(steps) > window:
        top.axvspan(steps[-window], steps[-1], color="0.9", zorder=0, label=f"last {window} steps")
    top.set_ylabel("training loss (token CE over the global batch)")
    top.legend()
    top.grid(alpha=0.3)
    top.set_title(f"{r['flavor']}: {r['steps']} steps, global batch {r['global_batch']} x seq {r['seq']}, "
                  f"{r['nproc']} x {r.get('device', '?')}, {r.get('dtype', '')}\n"
                  f"last-{window} mean: duoka {r['duoka_final']:.4f}, peer {r['peer_final']:.4f}, "
                  f"relative difference {100 * r['relative_difference']:.3f}%", fontsize=10)

    bottom.plot(steps, rel, color="tab:red", linewidth=1.0)
    bottom.axhline(0.0, color="0.4", linewidth=0.8)
    for level in (-1.0, 1.0):
        bottom.axhline(level, color="0.4", linestyle=":", linewidth=1.0, label="\u00b11%" if level > 0 else None)
    bottom.set_ylabel("(duoka - peer) / peer (%)")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    bottom.grid(alpha=0.3)

    fig.tight_layout()
    out = a.out or a.result.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
