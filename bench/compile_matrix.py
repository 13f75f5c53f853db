"""training.compile checked on every path one GPU runs, in one device call: plain DDP, FSDP2,
packed documents (varlen attention), chat SFT, activation checkpointing, the fused loss,
float8, load balancing with a slowed rank, and generation. (tp and pp need two processes,
so two GPUs: tests/distributed checks them compiled on CPU over gloo.)

Each case is launched twice with one compile cache folder of its own, first empty (cold),
then filled by the first launch (warm), as a user's first and second launch of a layout.
A launch records whether it ran compiled, the compile check's and step 1's compile seconds
(from the console), step 1's time and the median tokens/s of the steps after the third
(metrics.jsonl), peak memory, recompilations (TORCH_LOGS=recompiles) and the compile-cache
entries it wrote (a warm launch that finds every graph writes none). --eager adds a third,
uncompiled launch per case for the speed ratio. Generation runs `duoka generate` on the
documents case's exported model: cold, warm, eager; first-token time and decode speed.

The JSON is rewritten after every launch, so a run cut short keeps what it measured, and
launches that would overrun --budget-s are skipped (recorded as such).

    PYTHONPATH=$PWD python bench/compile_matrix.py --out $OUT/compile_matrix.json [--case sft ...] [--eager]
    # CPU smoke test (auto compiles on CUDA only, so compile is forced):
    python bench/compile_matrix.py --out /tmp/m.json --model debug --seq 64 --micro-batch 2 --steps 4 \\
        --compile true --case ddp

Reproduces bench/results/compile_matrix/ (the table in bench/NOTES.md section 21), which
README.md ("Benchmarking": the untuned default's 131,295 tok/s) and docs/training.md
(compile) cite: device kind nvidia-h200, from the repository root, torchao carried as a
wheel for the float8 case:

    PYTHONPATH=$PWD timeout 575 python3 bench/compile_matrix.py --out $OUT/compile_matrix.json --budget-s 545
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duoka.bench.training import run_process_group, stop_process_groups_on_signal
from duoka.errors import DuokaError

TOKENIZER = "--model.tokenizer=" + str(ROOT / "duoka" / "assets" / "tiny-qwen2")
# The cases, in the order they run (the most used paths first, should the budget cut the list).
CASES = {
    "ddp": ["--data.path=random"],
    # The bundled corpus and tokenizer, document masking on: varlen attention on CUDA.
    "documents (varlen)": [TOKENIZER],
    "generation": None,  # `duoka generate` on the documents case's export
    "fsdp": ["--data.path=random", "--parallel.dp_mode=fsdp"],
    "sft": ["--data.mode=sft", "--data.path={chat}", TOKENIZER],
    "checkpointing": ["--data.path=random", "--training.activation_checkpointing=full"],
    "fused loss": ["--data.path=random", "--training.fused_loss=true"],
    "float8": ["--data.path=random", "--training.float8=tensorwise"],
    # One GPU has one data-parallel rank, so its share never moves; what the path changes for
    # the compiler is there: the batch dimension marked dynamic, the block timer's hooks and
    # the slowed rank's spins between the compiled blocks.
    "balance (slowed rank)": ["--data.path=random", "--parallel.balance=auto", "--debug.slow_ranks=0:0.5"],
}
EXPORTER = "documents (varlen)"  # its cold launch exports the model generation runs on (it has a tokenizer)
GENERATE_PROMPT = "Return the"
_CHECK = re.compile(r"compile check: a decoder block compiled in ([\d.]+) s")
_STEP1 = re.compile(r"step 1 compiled in ([\d.]+) s")
_GENERATED = re.compile(r"generated (\d+) tokens in ([\d.]+) s \(first token (\d+) ms(?:, decode ([\d.]+) tokens/s)?")


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


def cache_entries(cache: Path) -> int:
    """Inductor's compiled graphs and AOTAutograd's entries in a compile cache folder."""
    return sum(1 for kind in ("fxgraph", "aotautograd") for p in (cache / kind).rglob("*") if p.is_file())


def launch_env(cache: Path) -> dict:
    """Every compiled artefact of the launch in `cache`, Triton's kernels included (a
    TRITON_CACHE_DIR of the caller's would make a cold launch warm)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_LOGS": "recompiles"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    return env


def run_launch(cmd: list[str], env: dict, cache: Path, timeout: float) -> tuple[dict, str]:
    """One process tree: its row (rc, wall, compile figures, recompiles, new cache entries)
    and its stderr."""
    before = cache_entries(cache)
    start = time.perf_counter()
    try:
        proc = run_process_group(cmd, timeout, env)
    except DuokaError as e:  # ran past the timeout: recorded, and the other cases still run
        return {"rc": None, "wall_s": time.perf_counter() - start, "error": e.cause}, ""
    row = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 2),
           "recompiles": proc.stderr.count("Recompiling function"),
           "new_cache_entries": cache_entries(cache) - before}
    if proc.returncode:
        row["error"] = proc.stderr[-2500:]
    return row, proc.stderr


def train(name: str, kind: str, flags: list[str], a: argparse.Namespace, work: Path) -> dict:
    """kind: cold | warm (compiled, the case's cache empty / filled) | eager."""
    slug = re.sub(r"[^a-z0-9]+", "_", name).strip("_")
    out, cache = work / f"{slug}-{kind}", work / f"cache-{slug}"
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={out}", f"--model.flavor={a.model}",
           f"--training.steps={a.steps}", f"--training.seq_len={a.seq}", f"--training.micro_batch_size={a.micro_batch}",
           f"--training.global_batch_size={a.micro_batch}", "--checkpoint.enabled=false",
           "--checkpoint.export_final=false", "--metrics.log_interval=1",
           f"--training.compile={'false' if kind == 'eager' else a.compile}", *flags,
           *(["--checkpoint.export_final=true"] if name == EXPORTER and kind == "cold" else [])]
    row, stderr = run_launch(cmd, launch_env(cache), cache, a.launch_timeout)
    row.update(case=name, kind=kind, compiled="| compiled |" in stderr)
    for key, pattern in (("check_s", _CHECK), ("step1_compile_s", _STEP1)):
        found = pattern.search(stderr)
        row[key] = float(found.group(1)) if found else None
    row["compile_warning"] = next((line for line in stderr.splitlines() if line.startswith("warning: torch.compile")),
                                  None)
    if row["rc"] != 0:
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s_per_gpu"] for r in records if r["step"] > 3]
    row["first_step_s"] = records[0]["step_time_s"]
    row["tokens_per_s"] = statistics.median(steady) if steady else None
    row["peak_mem_gib"] = max((r.get("peak_mem_gib") or 0) for r in records) or None
    row["final_loss"] = records[-1]["loss"]
    exported = sorted((out / "hf").glob("step-*"))
    if exported:
        row["exported"] = str(exported[-1])
    return row


def generate(kind: str, model: str, a: argparse.Namespace, work: Path) -> dict:
    cache = work / "cache-generation"
    cmd = [sys.executable, "-m", "duoka.cli", "generate", "--model", model, "--prompt", GENERATE_PROMPT,
           "--max-new-tokens", str(a.new_tokens), "--ignore-eos", *(["--enforce-eager"] if kind == "eager" else [])]
    row, stderr = run_launch(cmd, launch_env(cache), cache, a.launch_timeout)
    row.update(case="generation", kind=kind)
    found = _GENERATED.search(stderr)
    if found:
        row.update(generated=int(found.group(1)), generate_s=float(found.group(2)),
                   first_token_ms=int(found.group(3)), decode_tokens_per_s=float(found.group(4) or 0) or None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128, help="generation: tokens per launch")
    ap.add_argument("--case", action="append", choices=list(CASES), help="only these cases (default: all)")
    ap.add_argument("--eager", action="store_true", help="also an uncompiled launch per case (the speed ratio)")
    ap.add_argument("--compile", default="auto", choices=("auto", "true"),
                    help="training.compile of the compiled launches (true: to check on CPU, where auto is off)")
    ap.add_argument("--launch-timeout", type=float, default=240, help="seconds for one launch")
    ap.add_argument("--budget-s", type=float, default=540,
                    help="skip the launches that would end past this many seconds (a device call has 600)")
    a = ap.parse_args()
    import torch

    if a.compile == "auto" and not torch.cuda.is_available():
        raise SystemExit("error: no GPU here, and training.compile=auto compiles on CUDA only\n"
                         "  fix: run on a GPU, or pass --compile true to check on CPU (slowly)")
    stop_process_groups_on_signal()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="compile_matrix-"))
    chat = chat_file(work)
    cases = [name for name in CASES if not a.case or name in a.case]
    kinds = ["cold", "warm"] + (["eager"] if a.eager else [])
    result = {"model": a.model, "seq": a.seq, "micro_batch": a.micro_batch, "steps": a.steps, "compile": a.compile,
              "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else
              "cpu", "rows": []}
    longest: dict[str, float] = {}  # the longest launch of each kind so far: what the next may take

    def record(row: dict) -> None:
        result["rows"].append(row)
        longest[row["kind"]] = max(longest.get(row["kind"], 0.0), row.get("wall_s") or 0.0)
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        if row.get("error"):
            print(row["error"], flush=True)

    exported = None
    for name in cases:
        for kind in kinds:
            if time.perf_counter() - started + longest.get(kind, 0.0) > a.budget_s:
                record({"case": name, "kind": kind, "skipped": f"past the {a.budget_s:.0f} s budget"})
                continue
            if name == "generation":
                if exported is None:
                    record({"case": name, "kind": kind, "skipped": "no exported model (the documents case did "
                                                                   "not run or failed)"})
                    continue
                record(generate(kind, exported, a, work))
                continue
            row = train(name, kind, [f.format(chat=chat) for f in CASES[name]], a, work)
            exported = exported or row.get("exported")
            record(row)
    print_table(result["rows"])


def print_table(rows: list[dict]) -> None:
    def fmt(value, spec):  # a missing figure as "-", in the column's width
        if isinstance(value, (int, float)):
            return format(value, spec)
        return "-".rjust(int(re.match(r"\d*", spec).group() or 0))

    print(f"{'case':22} {'kind':5} {'rc':>3} {'check s':>8} {'step1 s':>8} {'first step s':>12} {'tok/s':>9} "
          f"{'recompiles':>10} {'new entries':>11}")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['case']:22} {r['kind']:5} skipped: {r['skipped']}")
            continue
        if r["case"] == "generation":
            print(f"{r['case']:22} {r['kind']:5} {fmt(r['rc'], '3d')} first token "
                  f"{fmt(r.get('first_token_ms'), 'd')} ms, decode {fmt(r.get('decode_tokens_per_s'), '.1f')} "
                  f"tok/s, wall {fmt(r.get('wall_s'), '.1f')} s")
            continue
        print(f"{r['case']:22} {r['kind']:5} {fmt(r['rc'], '3d')} {fmt(r.get('check_s'), '8.1f')} "
              f"{fmt(r.get('step1_compile_s'), '8.1f')} {fmt(r.get('first_step_s'), '12.2f')} "
              f"{fmt(r.get('tokens_per_s'), '9.0f')} {fmt(r.get('recompiles'), '10d')} "
              f"{fmt(r.get('new_cache_entries'), '11d')}")


if __name__ == "__main__":
    main()
