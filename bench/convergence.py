"""Convergence check: `duoka train` against a plain Hugging Face transformers training loop
(the peer), from the same initial weights, on the same batches in the same order, with the
same optimizer, learning-rate schedule, gradient clipping and loss normalisation.

    python bench/convergence.py --out bench/results/convergence.json          # every visible GPU: qwen2-0.5b, 200 steps
    python bench/plot_convergence.py bench/results/convergence.json           # -> convergence.png
    python bench/convergence.py --flavor debug --steps 6 --seq 32 --micro-batch 2 --global-batch 8 \
        --nproc 2 --dtype fp32 --layout-flags "--parallel.dp_mode=ddp"       # CPU, ~35 s (the test's run)

What each side does:
- Corpus: no network. The .py files of this Python's standard library (present on any
  Linux Python install; then torch's own .py files, should a stdlib without its test suite
  fall short), one file per document, written to WORKDIR/corpus.txt until it holds
  steps x global_batch x (seq + 1) tokens of duoka's bundled tokenizer (the `debug`
  flavor's, 4,096 entries; the Qwen2 flavors' 152k-row embeddings simply leave most rows
  unused). Tokenised once by duoka's own cached tokenizer path (DUOKA_CACHE=WORKDIR/cache),
  so both sides read the very same token file. The 200-step default needs 6.6 M tokens:
  ~23 M characters, about 1,400 stdlib files (Python 3.11 with its tests), ~20 s on 2 cores.
- Initial weights: the duoka model of --flavor, init_weights(seed), saved with duoka's
  Hugging Face adapter to WORKDIR/init (config.json + safetensors + the tokenizer files,
  which duoka train reads next to the weights). Both sides start from that folder.
- duoka: the real CLI (`python -m duoka.cli train --model.path=WORKDIR/init ...`) with
  --layout-flags for the layout and speed switches; per-step losses from metrics.jsonl.
- Peer: this file again under `python -m torch.distributed.run` (its own process group):
  transformers' Qwen2ForCausalLM.from_pretrained(WORKDIR/init, sdpa attention), fp32
  weights, bf16 autocast on GPU, DDP (NCCL on GPU, gloo on CPU), torch.optim.AdamW. Only
  the data pipeline (PackedWindows, rank_batches, step_inputs) and the lr function are
  imported from duoka, so the batches and the lr are the same by construction; the model,
  forward, loss and backward are transformers + plain PyTorch.

Loss normalisation on both sides: each micro-batch's summed token cross-entropy (fp32)
divided by the number of target tokens in the whole global batch, times the world size
to undo DDP's mean over ranks, accumulated over micro-batches with the gradient sync
skipped on all but the last. The logged loss is the global sum of cross-entropy over the
global number of target tokens, which is how the trainer writes `loss` to metrics.jsonl.

Output JSON: flavor, steps, seq, micro_batch, global_batch, nproc, duoka_flags, the two
loss curves, their means over the last 10 steps, the relative difference of those means
and whether it is within 1%, wall times; plus lr and gradient-norm curves for diagnosis.

Reproduces docs/performance.md's "Correctness of the fast path" and float8 loss figures and
their plots (bench/results/convergence*.json, drawn by bench/plot_convergence.py), which
docs/training.md cites too; device kind nvidia-h200-x2, from the repository root:

    PYTHONPATH=$PWD python bench/convergence.py --workdir /tmp/conv --out $OUT/convergence.json \
        --layout-flags "--parallel.dp_mode=ddp --training.compile=true --training.attention_kernel=cudnn"
    PYTHONPATH=$PWD python bench/convergence.py --out $OUT/convergence_float8.json --layout-flags \
        "--parallel.dp_mode=fsdp --parallel.reshard_after_forward=false --training.compile=true \
        --training.fused_loss=true --training.float8=tensorwise"

tests/integration/test_convergence_script.py runs the CPU form above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script (and under torchrun) without installing duoka
    sys.path.insert(0, str(ROOT))

FINAL_WINDOW = 10
GPU_LAYOUT_FLAGS = "--parallel.dp_mode=ddp --training.compile=true --training.fused_loss=true"
CPU_LAYOUT_FLAGS = "--parallel.dp_mode=ddp"
# The files that decide tokenisation; duoka train reads them from the model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CHARS_PER_TOKEN = 3.5  # a safe over-estimate for Python source under the 4k BPE (measured ~2.7)


def log(msg: str) -> None:
    print(f"convergence: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="duoka train vs a plain transformers loop: same weights, same data, "
                                            "same optimizer; compares the loss curves.")
    p.add_argument("--flavor", default="qwen2-0.5b", help="duoka model flavor (debug, qwen2-0.5b, ...)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--nproc", type=int, default=None, help="processes per side (default: visible GPUs, or 2 on CPU)")
    p.add_argument("--layout-flags", default=None,
                   help=f"extra duoka train overrides (default on GPU: {GPU_LAYOUT_FLAGS!r}; on CPU: "
                        f"{CPU_LAYOUT_FLAGS!r}); the hyperparameters below always win over them")
    p.add_argument("--peer-compile", action="store_true", help="torch.compile each transformers decoder layer")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute dtype of both sides (auto: bf16 on GPU, fp32 on CPU)")
    # Hyperparameters, fixed and given to both sides.
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (no batch-size scaling)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps // 10, at least 1)")
    p.add_argument("--schedule", choices=("cosine", "linear", "constant", "wsd"), default="cosine")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    p.add_argument("--workdir", type=Path, default=None, help="corpus, initial weights and runs (default: a new "
                                                              "temporary folder, kept)")
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here (default: WORKDIR/result.json)")
    p.add_argument("--timeout", type=int, default=7200, help="seconds per side")
    p.add_argument("--peer-worker", type=Path, default=None, help=argparse.SUPPRESS)  # internal: the torchrun side
    argv = list(sys.argv[1:] if argv is None else argv)
    # The layout string itself starts with "--", which argparse would take for an option:
    # `--layout-flags "--parallel.dp_mode=ddp ..."` is joined into one `--layout-flags=...`.
    for i in range(len(argv) - 1):
        if argv[i] == "--layout-flags":
            argv[i:i + 2] = [f"--layout-flags={argv[i + 1]}"]
            break
    return p.parse_args(argv)


# ---------------------------------------------------------------- corpus and weights


def corpus_sources() -> tuple[list[Path], str]:
    """Local Python source files in a fixed order: this Python's standard library first;
    then, for installs that ship it without its test suite (Debian's python3 packages, for
    one) and so fall short of a 200-step run, the .py files of the installed torch package,
    which every machine that runs this script has. Third-party packages below the stdlib
    folder (site-packages) are left out: they differ from machine to machine."""
    import torch

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(stdlib.rglob("*.py"))
             if not {"site-packages", "dist-packages"} & set(f.relative_to(stdlib).parts)]
    torch_dir = Path(torch.__file__).parent
    files += sorted(torch_dir.rglob("*.py"))
    source = (f"{stdlib}/**/*.py (Python {sys.version.split()[0]}), then {torch_dir}/**/*.py "
              f"(torch {torch.__version__})")
    return files, source


def write_corpus(path: Path, files: list[Path], target_chars: int) -> tuple[int, int, int]:
    """Whole files, one document each, until target_chars are written. duoka's .txt
    format separates documents by blank lines, so blank lines inside a file are dropped
    (keeping every file one document). Returns (documents, characters, files read)."""
    docs = chars = read = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for f in files:
            if chars >= target_chars:
                break
            read += 1
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few test files are deliberately not UTF-8
            lines = [line.rstrip() for line in text.replace("\r", "").splitlines()]
            doc = "\n".join(line for line in lines if line.strip())
            if doc:
                out.write(doc + "\n\n")
                docs += 1
                chars += len(doc)
    os.replace(tmp, path)
    return docs, chars, read


def build_corpus(workdir: Path, needed_tokens: int, tokenizer_dir: Path) -> dict:
    """WORKDIR/corpus.txt with at least needed_tokens tokens, and its cached token file
    (duoka's tokenize_corpus: the same call and cache key `duoka train` uses)."""
    import numpy as np

    from duoka.data.dataset import tokenize_corpus
    from duoka.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_dir)
    files, source = corpus_sources()
    corpus = workdir / "corpus.txt"
    target = int(needed_tokens * CHARS_PER_TOKEN)
    while True:
        docs, chars, read = write_corpus(corpus, files, target)
        token_file = tokenize_corpus(corpus, tokenizer)  # cached under DUOKA_CACHE, keyed by the file's stat
        n_tokens = len(np.load(token_file, mmap_mode="r"))
        if n_tokens >= needed_tokens or read == len(files):
            break
        target *= 2  # the estimate was short: write more files and tokenise again
    if n_tokens < needed_tokens:
        log(f"warning: the local sources give {n_tokens:,} tokens, fewer than the {needed_tokens:,} the run "
            "reads; later windows repeat (both sides see the same repeats)")
    return {"path": str(corpus), "token_file": str(token_file), "documents": docs, "chars": chars,
            "tokens": n_tokens, "source": source, "last_file": str(files[read - 1])}


def write_initial_weights(flavor: str, seed: int, out: Path, tokenizer_dir: Path) -> dict:
    """duoka's model of `flavor`, init_weights(seed), as a Hugging Face folder written by
    duoka's adapter (fp32), with the tokenizer files next to it."""
    import torch

    from duoka.models.qwen2 import build_model, get_flavor, materialize, save_hf_checkpoint

    args = get_flavor(flavor)
    model = materialize(build_model(args), "cpu", torch.float32)
    model.init_weights(seed=seed)
    extra = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    save_hf_checkpoint(model, out, max_shard_size="5GB", extra_files=extra)
    return {"path": str(out), "params": args.num_params(), "vocab_size": args.vocab_size}


# ---------------------------------------------------------------- the two sides


def optimizer_settings(a: argparse.Namespace) -> dict:
    """The hyperparameters both sides use, as duoka config keys (section -> key -> value)."""
    return {
        "optimizer": {"lr": a.lr, "lr_scaling": "none", "reference_batch_size": 0, "schedule": a.schedule,
                      "warmup_steps": a.warmup, "min_lr_ratio": a.min_lr_ratio, "weight_decay": a.weight_decay,
                      "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
        "training": {"steps": a.steps, "seq_len": a.seq, "global_batch_size": a.global_batch,
                     "micro_batch_size": a.micro_batch, "seed": a.seed, "dtype": a.dtype, "grad_clip": a.grad_clip},
        "data": {"document_masking": False},
    }


def child_env(workdir: Path) -> dict:
    env = {**os.environ, "DUOKA_CACHE": str(workdir / "cache"), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return env


def run_duoka(a: argparse.Namespace, workdir: Path, init: Path, corpus: Path, settings: dict) -> dict:
    run = workdir / "duoka-run"
    shutil.rmtree(run, ignore_errors=True)  # our own folder from an earlier call: duoka refuses to overwrite a run
    fixed = [f"--{section}.{key}={str(v).lower() if isinstance(v, bool) else v}"
             for section, values in settings.items() for key, v in values.items()]
    # Layout flags first, the fixed settings after: the last flag wins, so the
    # hyperparameters the peer also uses cannot be changed by the layout string.
    overrides = shlex.split(a.layout_flags) + [
        f"--job.output_dir={run}", f"--model.path={init}", f"--data.path={corpus}", *fixed,
        "--checkpoint.enabled=false", "--checkpoint.export_final=false", "--metrics.log_interval=10"]
    cmd = [sys.executable, "-m", "duoka.cli", "train", *overrides, f"--nproc-per-node={a.nproc}"]
    log("duoka: " + shlex.join(cmd[1:]))
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=child_env(workdir), timeout=a.timeout,
                          stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"duoka train failed (exit {proc.returncode}); its messages are above")
    _check_resolved_config(run / "config.toml", settings)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if [r["step"] for r in records] != list(range(1, a.steps + 1)):
        raise SystemExit(f"{run}/metrics.jsonl does not hold steps 1..{a.steps}")
    return {"losses": [r["loss"] for r in records], "lr": [r["lr"] for r in records],
            "grad_norm": [r["grad_norm"] for r in records], "step_time_s": [r["step_time_s"] for r in records],
            "tokens_per_s_per_gpu": [r["tokens_per_s_per_gpu"] for r in records], "wall_s": wall,
            "flags": overrides + [f"--nproc-per-node={a.nproc}"], "run_dir": str(run)}


def _check_resolved_config(path: Path, settings: dict) -> None:
    """The run's resolved config must hold exactly the values given to the peer."""
    from duoka.config import tomllib  # tomllib, or tomli on Python 3.10

    resolved = tomllib.loads(path.read_text())
    for section, values in settings.items():
        for key, want in values.items():
            got = resolved[section][key]
            if got != want and not (isinstance(want, float) and abs(got - want) <= 1e-12 * abs(want)):
                raise SystemExit(f"duoka's resolved {section}.{key} is {got!r}, the peer uses {want!r}")


def run_peer(a: argparse.Namespace, workdir: Path, init: Path, token_file: str, settings: dict) -> dict:
    result_path = workdir / "peer-result.json"
    result_path.unlink(missing_ok=True)
    spec = {"init": str(init), "token_file": token_file, "settings": settings, "compile": a.peer_compile,
            "result": str(result_path)}
    spec_path = workdir / "peer-spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = child_env(workdir)
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would give every CPU worker one thread; duoka gives them a fair share of
        # the cores. The same share here keeps CPU timings comparable.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // a.nproc))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(Path(__file__).resolve()), "--peer-worker", str(spec_path)]
    log("peer: " + shlex.join(cmd[1:]))
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, timeout=a.timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    if proc.returncode != 0 or not result_path.is_file():
        raise SystemExit(f"the peer failed (exit {proc.returncode}); its messages are above")
    return {**json.loads(result_path.read_text()), "wall_s": wall}


def peer_worker(spec_path: Path) -> None:
    """One rank of the transformers peer (started by torch.distributed.run)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Qwen2ForCausalLM

    # From duoka only what defines the data and the lr, so both sides get them identically.
    from duoka.config import OptimizerConfig
    from duoka.data.dataset import PackedWindows, rank_batches, step_inputs
    from duoka.train.lr_schedule import effective_lr, lr_at

    spec = json.loads(spec_path.read_text())
    train, opt_cfg = spec["settings"]["training"], OptimizerConfig(**spec["settings"]["optimizer"])
    steps, seq, global_batch, micro = train["steps"], train["seq_len"], train["global_batch_size"], \
        train["micro_batch_size"]
    ignore_index = -100  # torch's default, and duoka's IGNORE_INDEX

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    dtype = train["dtype"]
    # fp32 master weights; bf16 compute under autocast (what DDP + AMP users do, and what duoka does under DDP).
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    t_load = time.perf_counter()
    model = Qwen2ForCausalLM.from_pretrained(spec["init"], dtype=torch.float32, attn_implementation="sdpa")
    model = model.float().to(device)  # float(): transformers < 4.56 ignores `dtype=` (fp32 is its default anyway)
    model.config.use_cache = False
    model.train()
    if spec["compile"]:
        for layer in model.model.layers:
            layer.compile()
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    load_s = time.perf_counter() - t_load

    # AdamW as duoka builds it (duoka.train.optimizers.build_optimizer): decoupled weight decay on
    # parameters with 2 or more dimensions only, the tied embedding/head counted once
    # (model.parameters() yields a shared tensor once); fused on GPU, foreach on CPU.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    peak_lr = effective_lr(opt_cfg, global_batch)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps, fused=cuda,
        foreach=None if cuda else True)
    max_norm = train["grad_clip"] if train["grad_clip"] > 0 else float("inf")

    data = PackedWindows(Path(spec["token_file"]), seq)

    def summed_ce(batch: dict) -> torch.Tensor:
        # A function of its own so the logits are freed before backward (as duoka does).
        with amp:
            logits = ddp(input_ids=batch["tokens"], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="sum",
                               ignore_index=ignore_index)

    losses, lrs, norms, step_times, tokens_per_s = [], [], [], [], []
    started = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        # This rank's micro-batches of this step: duoka's global order and rank slice, with
        # no document masking (tokens and shifted labels only).
        host = [step_inputs(b, ignore_index, None, False)
                for b in rank_batches(data, step, global_batch, micro, rank, world, train["seed"])]
        local_tokens = sum(int((b["labels"] != ignore_index).sum()) for b in host)
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in host]
        global_tokens = torch.tensor(float(local_tokens), device=device, dtype=torch.float64)
        dist.all_reduce(global_tokens)
        global_tokens = global_tokens.float()

        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():
                ce = summed_ce(batch)
                # x world: DDP averages gradients over ranks; this makes the sum of all
                # ranks' gradients that of sum(CE) / global target tokens.
                (ce * world / global_tokens).backward()
            loss_sum += ce.detach()

        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        lr = lr_at(step, steps, peak_lr, opt_cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0

        # The logged loss as duoka's metrics.jsonl: every rank's summed CE over every rank's tokens.
        row = torch.tensor([loss_sum.item(), float(local_tokens), dt], device=device, dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        rows = torch.stack(rows).cpu()
        loss = float(rows[:, 0].sum() / rows[:, 1].sum())
        slowest = float(rows[:, 2].max())
        losses.append(loss)
        lrs.append(lr)
        norms.append(float(norm))
        step_times.append(slowest)
        tokens_per_s.append(float(rows[:, 1].sum()) / slowest / world)
        if rank == 0 and (step == 0 or (step + 1) % 10 == 0 or step + 1 == steps):
            print(f"peer step {step + 1:>5}/{steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {float(norm):.3f} | "
                  f"{tokens_per_s[-1]:,.0f} tok/s/proc | {slowest:.2f} s/step", file=sys.stderr, flush=True)

    train_s = time.perf_counter() - started
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({
            "losses": losses, "lr": lrs, "grad_norm": norms, "step_time_s": step_times,
            "tokens_per_s_per_gpu": tokens_per_s, "load_s": load_s, "train_s": train_s, "dtype": dtype,
            "device": device.type}))
    # Every rank's work ended with the last step's all-gather, and rank 0's result is on
    # disk, so nothing is left to agree on. Leave without tearing down: a CPU (gloo)
    # worker once never returned from the closing barrier/destroy_process_group after
    # both sides had finished (CI, 2026-11-30), and torchrun waited on it until the
    # caller's timeout. os._exit skips the interpreter's finalizers, which only touch
    # the process group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- driver


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


def steady_median(values: list[float], skip: int = 5) -> float | None:
    """Median over the steps after the first few (compilation and warm-up)."""
    tail = values[skip:] or values
    return statistics.median(tail) if tail else None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.peer_worker is not None:
        peer_worker(a.peer_worker)
        return 0

    import torch

    gpus = torch.cuda.device_count()  # counts devices without creating a CUDA context here
    a.nproc = a.nproc or (gpus if gpus else 2)
    if a.layout_flags is None:
        a.layout_flags = GPU_LAYOUT_FLAGS if gpus else CPU_LAYOUT_FLAGS
    if a.dtype == "auto":  # resolved here so both sides are told the same explicit dtype
        a.dtype = "bf16" if gpus else "fp32"
    if a.warmup is None:
        a.warmup = max(1, a.steps // 10)
    if a.global_batch % a.nproc or (a.global_batch // a.nproc) % a.micro_batch:
        raise SystemExit(f"--global-batch {a.global_batch} must be --nproc {a.nproc} x a multiple of --micro-batch "
                         f"{a.micro_batch}")
    workdir = (a.workdir or Path(tempfile.mkdtemp(prefix="duoka-convergence-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ["DUOKA_CACHE"] = str(workdir / "cache")  # our tokenize_corpus call and duoka train's share it
    out = (a.out or workdir / "result.json").resolve()
    log(f"workdir {workdir}")

    from duoka.hub import bundled_model_dir

    t_all = time.perf_counter()
    tokenizer_dir = bundled_model_dir()  # the tokenizer the debug flavor trains with (4,096 tokens)
    needed = a.steps * a.global_batch * (a.seq + 1)
    t = time.perf_counter()
    corpus = build_corpus(workdir, needed, tokenizer_dir)
    corpus_s = time.perf_counter() - t
    log(f"corpus {corpus['path']}: {corpus['documents']} files, {corpus['tokens']:,} tokens (needs {needed:,}), "
        f"{corpus_s:.1f} s")

    t = time.perf_counter()
    init = workdir / "init"
    weights = write_initial_weights(a.flavor, a.seed, init, tokenizer_dir)
    init_s = time.perf_counter() - t
    log(f"initial weights {init}: {a.flavor}, {weights['params'] / 1e6:.1f}M parameters, seed {a.seed}, "
        f"{init_s:.1f} s")

    settings = optimizer_settings(a)
    duoka = run_duoka(a, workdir, init, Path(corpus["path"]), settings)
    peer = run_peer(a, workdir, init, corpus["token_file"], settings)

    window = min(FINAL_WINDOW, a.steps)
    duoka_final = statistics.fmean(duoka["losses"][-window:])
    peer_final = statistics.fmean(peer["losses"][-window:])
    rel = relative(duoka_final, peer_final)
    per_step = [relative(d, p) for d, p in zip(duoka["losses"], peer["losses"])]
    result = {
        "flavor": a.flavor, "steps": a.steps, "seq": a.seq, "micro_batch": a.micro_batch,
        "global_batch": a.global_batch, "nproc": a.nproc, "device": "cuda" if gpus else "cpu",
        "dtype": peer["dtype"], "duoka_flags": duoka["flags"], "peer_compile": a.peer_compile,
        "hyperparameters": settings,
        "duoka": duoka["losses"], "peer": peer["losses"],
        "final_window": window, "duoka_final": duoka_final, "peer_final": peer_final,
        "relative_difference": rel, "within_1pct": rel <= 0.01,
        "first_step_relative_difference": per_step[0], "max_step_relative_difference": max(per_step),
        "wall_s": {"corpus": corpus_s, "init": init_s, "duoka": duoka["wall_s"], "peer": peer["wall_s"],
                   "total": time.perf_counter() - t_all},
        "tokens_per_s_per_gpu": {"duoka": steady_median(duoka["tokens_per_s_per_gpu"]),
                                 "peer": steady_median(peer["tokens_per_s_per_gpu"])},
        "details": {"duoka_lr": duoka["lr"], "peer_lr": peer["lr"], "duoka_grad_norm": duoka["grad_norm"],
                    "peer_grad_norm": peer["grad_norm"], "duoka_step_time_s": duoka["step_time_s"],
                    "peer_step_time_s": peer["step_time_s"], "peer_load_s": peer["load_s"],
                    "corpus": corpus, "initial_weights": weights, "duoka_run_dir": duoka["run_dir"],
                    "torch": torch.__version__, "transformers": _version("transformers"),
                    "gpu": torch.cuda.get_device_name(0) if gpus else None},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{a.flavor} {a.steps} steps x {a.global_batch} x {a.seq} on {a.nproc} {result['device']} "
          f"({result['dtype']}): last-{window} mean loss duoka {duoka_final:.4f} peer {peer_final:.4f}, "
          f"relative difference {100 * rel:.3f}% ({'within' if rel <= 0.01 else 'NOT within'} 1%); "
          f"step 1 {duoka['losses'][0]:.5f} vs {peer['losses'][0]:.5f}; "
          f"wall duoka {duoka['wall_s']:.0f} s, peer {peer['wall_s']:.0f} s -> {out}", flush=True)
    return 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
