"""Compiled against eager training on one GPU, for the data and memory paths a default run
can take: packed documents with document masking (varlen attention), chat SFT (masked
targets), activation checkpointing, the fused loss. Each case is a short `duoka train`
run; the table gives the median tokens/s of the steps after the first three, the peak
memory and the number of recompilations (TORCH_LOGS=recompiles).

    python bench/compile_matrix.py --out $OUT/compile_matrix.json [--model qwen2-0.5b] [--case sft ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKENIZER = "--model.tokenizer=" + str(Path(__file__).resolve().parents[1] / "duoka" / "assets" / "tiny-qwen2")
CASES = {
    # The bundled corpus and tokenizer, document masking on: varlen attention on CUDA.
    "documents (varlen)": [TOKENIZER],
    "sft": ["--data.mode=sft", "--data.path={chat}", TOKENIZER],
    "checkpointing": ["--data.path=random", "--training.activation_checkpointing=full"],
    "fused loss": ["--data.path=random", "--training.fused_loss=true"],
}


def chat_file(folder: Path) -> Path:
    """Conversations of random words and lengths: SFT windows of varying content."""
    rng = random.Random(0)
    words = "the a GPU trains many cards quickly model layer token batch gradient loss step".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    path = folder / "chat.jsonl"
    with path.open("w") as f:
        for _ in range(400):
            messages = [{"role": "user", "content": text(rng.randint(5, 300))},
                        {"role": "assistant", "content": text(rng.randint(5, 600))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def run(name: str, flags: list[str], compiled: bool, a: argparse.Namespace, work: Path) -> dict:
    out = work / f"{name.replace(' ', '_')}-{'compiled' if compiled else 'eager'}"
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={out}", f"--model.flavor={a.model}",
           f"--training.steps={a.steps}", f"--training.seq_len={a.seq}", f"--training.micro_batch_size={a.micro_batch}",
           f"--training.global_batch_size={a.micro_batch}", "--checkpoint.interval=0", f"--training.compile={str(compiled).lower()}",
           *flags]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TORCH_LOGS": "recompiles"},
                              timeout=a.case_timeout)
    except subprocess.TimeoutExpired as e:  # recorded, and the other cases still run
        return {"case": name, "compiled": compiled, "rc": None, "error": f"timeout after {a.case_timeout} s: "
                f"{(e.stderr or b'')[-1500:]!r}"}
    row = {"case": name, "compiled": compiled, "rc": proc.returncode, "wall_s": time.perf_counter() - start,
           "recompiles": proc.stderr.count("Recompiling function")}
    if proc.returncode:
        row["error"] = proc.stderr[-1500:]
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s_per_gpu"] for r in records if r["step"] > 3]
    row["tokens_per_s"] = statistics.median(steady) if steady else None
    row["peak_mem_gib"] = max((r.get("peak_mem_gib") or 0) for r in records) or None
    row["final_loss"] = records[-1]["loss"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--case", action="append", help="only these cases (default: all)")
    ap.add_argument("--case-timeout", type=float, default=300, help="seconds for one training run")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compile_matrix-"))
    chat = chat_file(work)
    rows = []
    cases = {name: flags for name, flags in CASES.items() if not a.case or name in a.case}
    for name, flags in cases.items():
        for compiled in (True, False):
            row = run(name, [f.format(chat=chat) for f in flags], compiled, a, work)
            print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
            if "error" in row:
                print(row["error"], flush=True)
            rows.append(row)
    Path(a.out).write_text(json.dumps({"model": a.model, "rows": rows}, indent=1) + "\n")
    print(f"{'case':22} {'compiled tok/s':>15} {'eager tok/s':>12} {'ratio':>6} {'recompiles':>10}")
    for name in cases:
        c, e = (next(r for r in rows if r["case"] == name and r["compiled"] == flag) for flag in (True, False))
        ratio = c["tokens_per_s"] / e["tokens_per_s"] if c.get("tokens_per_s") and e.get("tokens_per_s") else None
        print(f"{name:22} {c.get('tokens_per_s') or 0:15.0f} {e.get('tokens_per_s') or 0:12.0f} "
              f"{ratio or 0:6.2f} {c.get('recompiles', -1):10d}")


if __name__ == "__main__":
    main()
