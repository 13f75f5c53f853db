"""The optimizers of issue 27 on one GPU, one device call per mode.

--mode throughput (the default): Qwen2-7B full fine-tuning at seq 2048 on random tokens,
compiled, bf16 with fp32 master weights, one `duoka train` per optimizer: peak memory,
tokens/s and MFU (medians over the steps after the warm-up, from metrics.jsonl). adamw with
full activation checkpointing at micro-batch 1 is today's baseline (measured 7,815 tok/s,
117.9 GiB in the issue); every other optimizer runs at the largest micro-batch and least
recomputation estimated to fit 139 GiB (ESTIMATES below), falling back to the next attempt
of its case when the first runs out of memory.

--mode curves: 200-step loss curves of adamw, adamw8bit, adafactor and muon on Qwen2-0.5B
from the same initial weights (training.seed) and the same data (the bundled corpus, read
with the bundled tokenizer), each at its usual lr; the losses of every step go to the JSON,
which bench/plot_optimizers.py draws.

--mode check: what the CPU tests cannot run, on the debug flavor: optimizer.offload=cpu and
the compiled adamw8bit step resume bit for bit from a checkpoint, and offload skips a
non-finite step (its clip and skip run inside the host's fused AdamW).

Every case runs with one compile cache for the call (cases that share a shape compile once).
The JSON is rewritten after every launch, so a call cut short keeps what it measured; a case
whose estimate would end past --budget-s is skipped and recorded as such.

    PYTHONPATH=$PWD timeout 590 python3 bench/optimizers_7b.py --out $OUT/optimizers_7b.json
    PYTHONPATH=$PWD timeout 590 python3 bench/optimizers_7b.py --mode curves --out $OUT/optimizer_curves.json
    # CPU smoke test of the script itself:
    python bench/optimizers_7b.py --out /tmp/o.json --model debug --seq 64 --steps 4 --compile false \\
        --case adamw:2:none --case muon:2:none

docs/training.md (optimizers) names this script as the GPU run its optimizer figures still
wait for (device kind nvidia-h200); bench/plot_optimizers.py draws the curves of --mode curves.
"""

from __future__ import annotations

import argparse
import json
import os
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
FLAVOR = {"7b": "qwen2-7b", "0.5b": "qwen2-0.5b", "debug": "debug"}
PARAMS_7B = 7.62e9
# How each case's memory was estimated for Qwen2-7B on one H200 (139 GiB), in GiB: fp32
# weights and gradients 56.8; the bf16 weights that autocast casts and backward keeps, ~14
# without recomputation; activations ~8 per sample of 2048 tokens without recomputation (the
# tuned peer's FSDP2 run: 93.3 GiB at micro-batch 4, 56.8 of it state); plus each optimizer's
# state: adamw 56.8, adamw8bit ~14.4, adamw4bit ~7.2, adafactor ~0.1, muon 32.5 (4 bytes for
# the block matrices, 8 for the 1.09e9 embedding and head parameters), sgd 28.4, offloaded
# adamw 0 (the host holds 16 bytes per parameter: ~122 GB). The first attempt of each case
# is the largest estimated to fit with ~10 GiB to spare, the next the fallback.
ESTIMATES = {
    "adamw8bit": "5:none,4:none",  # 71 + 14 + 8 x 5 = 125 GiB
    "adafactor": "6:none,4:none",  # 57 + 14 + 48 = 119 GiB (and its step's full-size temporaries)
    "muon": "3:none,2:none",  # 89 + 14 + 24 = 127 GiB
    "adamw4bit": "6:none,5:none",  # 64 + 14 + 48 = 126 GiB
    "sgd": "3:none,2:none",  # 85 + 14 + 24 = 123 GiB
    "adamw-offload": "6:none,4:none",  # 57 + 14 + 48 = 119 GiB on the GPU
}
# The baseline first (what the others are measured against), then by the interest.
DEFAULT_CASES = ("adamw:1:full", *(f"{name}:{attempts}" for name, attempts in ESTIMATES.items()))
# Seconds a 7B case may take (start, random init, compile, 8 steps): a guess before the first
# reading; the longest case measured so far replaces it.
CASE_SECONDS = 110
# Host memory the offloaded 7B AdamW pins and keeps: fp32 master copy, gradient, two moments.
OFFLOAD_HOST_BYTES = 16 * PARAMS_7B
CURVES = ("adamw:1e-3", "adamw8bit:1e-3", "adafactor:1e-2", "muon:1e-3")  # name:lr (adafactor's lr is relative)


def optimizer_flags(name: str) -> list[str]:
    if name == "adamw-offload":
        return ["--optimizer.name=adamw", "--optimizer.offload=cpu"]
    return [f"--optimizer.name={name}"]


def launch(flags: list[str], run: Path, a: argparse.Namespace, cache: Path, timeout: float) -> tuple[dict, str]:
    """One `duoka train` in a process group of its own; its row and its stderr."""
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", "--nproc-per-node=1",
           "--checkpoint.enabled=false", "--checkpoint.export_final=false", "--metrics.log_interval=1",
           f"--training.compile={a.compile}", f"--training.compile_cache={cache}",
           *[f"--{s}" for s in a.set], *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    try:
        proc = run_process_group(cmd, timeout, env)
    except DuokaError as e:
        return {"rc": None, "wall_s": round(time.perf_counter() - start, 1), "error": e.cause, "command": cmd}, ""
    row = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1), "command": cmd}
    if proc.returncode:
        row["error"] = proc.stderr[-2500:]
        row["out_of_memory"] = "out of memory" in proc.stderr.lower()
    return row, proc.stderr


def figures(run: Path, warmup: int, tokens_per_step: int) -> dict:
    """Medians over the steps after the warm-up (metrics.jsonl)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = records[warmup:] or records[-1:]
    step = statistics.median(r["step_time_s"] for r in timed)
    mfu = [r["mfu"] for r in timed if r.get("mfu")]
    return {"tokens_per_s": round(tokens_per_step / step), "mfu_pct": round(100 * statistics.median(mfu), 1)
            if mfu else None, "peak_mem_gib": round(max(r.get("peak_mem_gib") or 0 for r in records), 1) or None,
            "step_s": round(step, 3), "optimizer_s": round(statistics.median(r["phase_s"]["optimizer"] for r in timed),
                                                          4),
            "first_step_s": round(records[0]["step_time_s"], 1), "final_loss": round(records[-1]["loss"], 4)}


def host_memory_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def throughput(a: argparse.Namespace, result: dict, save, work: Path, cache: Path, started: float) -> None:
    longest = CASE_SECONDS if a.model == "7b" else 30
    for case in a.case or DEFAULT_CASES:
        name, _, attempts = case.partition(":")
        row = {"case": case, "optimizer": name, "attempts": []}
        result["rows"].append(row)
        if name == "adamw-offload" and a.model == "7b":
            free = host_memory_available()
            if free is not None and free < 1.05 * OFFLOAD_HOST_BYTES:
                row["skipped"] = (f"the offloaded AdamW of Qwen2-7B keeps ~{OFFLOAD_HOST_BYTES / 1e9:.0f} GB in host "
                                  f"memory; {free / 1e9:.0f} GB is available")
                save()
                continue
        for attempt in attempts.split(","):
            mb, ac = attempt.split(":")
            left = a.budget_s - (time.perf_counter() - started)
            if left < longest:
                row["attempts"].append({"micro_batch": int(mb), "activation_checkpointing": ac,
                                        "skipped": f"{left:.0f} s of the budget left, a case takes about "
                                                   f"{longest:.0f} s"})
                break
            flags = [f"--model.flavor={FLAVOR[a.model]}", "--data.path=random", f"--training.seq_len={a.seq}",
                     f"--training.micro_batch_size={mb}", f"--training.global_batch_size={mb}",
                     f"--training.activation_checkpointing={ac}", f"--training.steps={a.steps}",
                     "--training.dtype=bf16", "--optimizer.warmup_steps=2", *optimizer_flags(name)]
            run = work / f"{name}-mb{mb}-{ac}"
            got, _ = launch(flags, run, a, cache, min(a.timeout, left))
            got.update(micro_batch=int(mb), activation_checkpointing=ac)
            if got["rc"] == 0:
                got.update(figures(run, a.warmup, int(mb) * a.seq))
            row["attempts"].append(got)
            longest = max(longest, got["wall_s"])
            save()
            print(json.dumps({k: v for k, v in got.items() if k not in ("command", "error")}), flush=True)
            if got["rc"] != 0:
                print(got.get("error", ""), flush=True)
            if not got.get("out_of_memory"):
                break
        done = [t for t in row["attempts"] if t.get("tokens_per_s")]
        if done:
            row.update({k: done[0][k] for k in ("micro_batch", "activation_checkpointing", "tokens_per_s", "mfu_pct",
                                                "peak_mem_gib", "step_s", "optimizer_s")})
        save()
    base = next((r["tokens_per_s"] for r in result["rows"] if r["case"] == "adamw:1:full" and "tokens_per_s" in r),
                None)
    for r in result["rows"]:
        if base and "tokens_per_s" in r:
            r["vs_adamw_baseline"] = round(r["tokens_per_s"] / base, 3)
    save()
    print(f"{'optimizer':<15}{'mb':>4}{'AC':>6}{'tok/s':>9}{'MFU %':>7}{'GiB':>7}{'opt s':>8}{'x base':>8}")
    for r in result["rows"]:
        if "tokens_per_s" not in r:
            why = r.get("skipped") or next((t.get("skipped") or ("out of memory" if t.get("out_of_memory") else "error")
                                            for t in reversed(r["attempts"])), "-")
            print(f"{r['optimizer']:<15} {why}")
            continue
        print(f"{r['optimizer']:<15}{r['micro_batch']:>4}{r['activation_checkpointing']:>6}{r['tokens_per_s']:>9}"
              f"{r['mfu_pct'] or '-':>7}{r['peak_mem_gib'] or '-':>7}{r['optimizer_s']:>8}"
              f"{r.get('vs_adamw_baseline', '-'):>8}")


def curves(a: argparse.Namespace, result: dict, save, work: Path, cache: Path, started: float) -> None:
    result.update(global_batch=a.global_batch, schedule="cosine", warmup_steps=a.curve_warmup, data="bundled corpus")
    longest = 120 if a.model == "0.5b" else 30
    for case in a.case or CURVES:
        name, _, lr = case.partition(":")
        row = {"optimizer": name, "lr": float(lr)}
        result["rows"].append(row)
        left = a.budget_s - (time.perf_counter() - started)
        if left < longest:
            row["skipped"] = f"{left:.0f} s of the budget left, a case takes about {longest:.0f} s"
            save()
            continue
        flags = [f"--model.flavor={FLAVOR[a.model]}", TOKENIZER, f"--training.seq_len={a.seq}",
                 f"--training.global_batch_size={a.global_batch}", f"--training.steps={a.steps}",
                 "--training.dtype=bf16", f"--optimizer.lr={lr}", f"--optimizer.warmup_steps={a.curve_warmup}",
                 *optimizer_flags(name)]
        run = work / f"curve-{name}"
        got, _ = launch(flags, run, a, cache, min(a.timeout, left))
        row.update(got)
        if got["rc"] == 0:
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            row["losses"] = [r["loss"] for r in records]
            row.update(figures(run, a.warmup, a.global_batch * a.seq))
        longest = max(longest, got["wall_s"])
        save()
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "error", "losses")}), flush=True)
        if got["rc"] != 0:
            print(got.get("error", ""), flush=True)


def check(a: argparse.Namespace, result: dict, save, work: Path, cache: Path, started: float) -> None:
    """Resume exactness and a skipped non-finite step, for what only runs on a GPU."""
    common = ["--model.flavor=debug", "--data.path=random", "--training.seq_len=128", "--training.global_batch_size=8",
              "--training.steps=6", "--optimizer.warmup_steps=2"]
    for name in ("adamw-offload", "adamw8bit"):
        full, resumed = work / f"check-{name}", work / f"check-{name}-resumed"
        row = {"optimizer": name}
        result["rows"].append(row)
        a_flags = [*common, *optimizer_flags(name)]
        got, _ = launch([*a_flags, "--checkpoint.enabled=true", "--checkpoint.interval=3"], full, a, cache, a.timeout)
        row["full"] = got
        if got["rc"] == 0:
            got, stderr = launch([*a_flags, f"--checkpoint.resume={full / 'checkpoints' / 'step-3'}"], resumed, a,
                                 cache, a.timeout)
            row["resumed"] = got
            if got["rc"] == 0:
                before = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()][3:]
                after = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
                row["resume_exact"] = [(r["loss"], r["grad_norm"]) for r in before] == \
                                      [(r["loss"], r["grad_norm"]) for r in after]
                row["losses"] = {"uninterrupted": [r["loss"] for r in before], "resumed": [r["loss"] for r in after]}
        if name == "adamw-offload":
            skipped = work / "check-offload-nan"
            got, _ = launch([*a_flags, "--debug.inject_nan_step=2", "--reliability.max_nonfinite_steps=3"], skipped, a,
                            cache, a.timeout)
            row["nan_step"] = got
            if got["rc"] == 0:
                records = [json.loads(line) for line in (skipped / "metrics.jsonl").read_text().splitlines()]
                row["nan_step_skipped"] = [r["health"]["skipped"] for r in records]
                row["losses_after_nan"] = [r["loss"] for r in records]
        save()
        print(json.dumps({k: v for k, v in row.items() if k not in ("full", "resumed", "nan_step")}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("throughput", "curves", "check"), default="throughput")
    p.add_argument("--model", choices=tuple(FLAVOR), default=None, help="default: 7b (throughput), 0.5b (curves)")
    p.add_argument("--case", action="append", default=[],
                   help="throughput: optimizer:micro-batch:ac[,micro-batch:ac...] (ac: none or full; the attempts "
                        f"after the first run when it is out of memory), default {' '.join(DEFAULT_CASES)}; "
                        f"optimizer adamw-offload is adamw with optimizer.offload=cpu. curves: optimizer:lr, default "
                        f"{' '.join(CURVES)}")
    p.add_argument("--seq", type=int, default=None, help="default: 2048 (throughput), 512 (curves)")
    p.add_argument("--steps", type=int, default=None, help="default: 8 (throughput), 200 (curves)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians (the first compiles)")
    p.add_argument("--global-batch", type=int, default=8, help="curves: samples per step")
    p.add_argument("--curve-warmup", type=int, default=20, help="curves: lr warmup steps")
    p.add_argument("--compile", default="true", choices=("true", "false"), help="training.compile")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra duoka train setting for every launch (repeatable)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--budget-s", type=float, default=570, help="skip cases that would end past this (a call has 600)")
    a = p.parse_args()
    curve_mode = a.mode == "curves"
    a.model = a.model or ("0.5b" if curve_mode else "debug" if a.mode == "check" else "7b")
    a.seq = a.seq or (512 if curve_mode else 2048)
    a.steps = a.steps or (200 if curve_mode else 8)
    import torch

    stop_process_groups_on_signal()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="optimizers-"))
    cache = work / "compile-cache"
    result = {"mode": a.mode, "model": FLAVOR[a.model], "seq": a.seq, "steps": a.steps, "warmup_steps_left_out":
              a.warmup, "compile": a.compile, "extra": a.set, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "rows": []}

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        a.out.write_text(json.dumps(result, indent=1) + "\n")

    {"throughput": throughput, "curves": curves, "check": check}[a.mode](a, result, save, work, cache, started)
    save()


if __name__ == "__main__":
    main()
