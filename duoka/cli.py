"""The `duoka` command. Subcommands are thin: they parse flags and call the library.

User errors (DuokaError) end in two lines, the cause and the fix, and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import textwrap
import time
from pathlib import Path

from duoka import __version__, runtime
from duoka.cache import compile_cache_env
from duoka.config import split_overrides, suggest_key
from duoka.errors import DuokaError, file_error
from duoka.hub import bundled_model_dir

DEFAULT_PROMPT = "Return the"  # the bundled model read only standard-library docstrings
# Descriptions are wrapped here (the formatter keeps them and the examples as written): 78
# columns leave a margin in an 80-column terminal.
HELP_WIDTH = 78


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """argparse, except that a mistake on the command line is a DuokaError like every other
    user error (two lines, `error:` and `fix:`, exit code 2), not a usage dump."""

    def error(self, message: str):
        command = re.match(r"argument COMMAND: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if command:  # `duoka trian`
            close = difflib.get_close_matches(command[1], re.findall(r"'([^']*)'", command[2]), n=1)
            raise DuokaError(f"unknown command {command[1]!r}", (f"did you mean {close[0]}? " if close else "") +
                             f"`{self.prog} --help` lists the commands")
        raise DuokaError(message, f"`{self.prog} --help` lists the flags, each with its default")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; every option's help states its default, added
    here where the text does not say it (flags that are off unless given have none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, [], argparse.SUPPRESS) \
                or isinstance(action.default, bool):
            return text
        return f"{text} (default: %(default)s)"


def add_command(sub, name: str, help: str, description: str, examples: tuple[str, ...]) -> argparse.ArgumentParser:
    """One subcommand: its line in `duoka --help`, its description, and examples after its flags."""
    p = sub.add_parser(name, help=help, description=textwrap.fill(description, HELP_WIDTH),
                       epilog="examples:\n" + "\n".join(f"  {line}" for line in examples), formatter_class=HelpFormatter)
    p.set_defaults(command_parser=p)  # the innermost command's parser: unknown_argument names its flags
    return p


# ---------------------------------------------------------------- generate


def add_generate_parser(sub) -> None:
    from duoka.serve.config import GENERATE, add_engine_flags

    p = add_command(sub, "generate", "try a model on one prompt: a run's hf/step-N, a hub id or a folder; the text "
                                     "streams to stdout",
                    "Generate a continuation of PROMPT on the serving engine (the one under `duoka serve`). Only the "
                    "generated text goes to stdout; load and speed figures go to stderr.",
                    ("duoka generate   # the bundled tiny model, prompt \"Return the\"",
                     "duoka generate --model runs/a/hf/step-1000 --prompt \"The capital of France is\"",
                     "duoka generate --model Qwen/Qwen2.5-0.5B-Instruct --chat --prompt \"Hi\""))
    p.add_argument("--prompt", default=None, help="prompt text (default: read stdin when it is not a terminal)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (fewer when the model "
                   "ends its text)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: sample from the most likely tokens "
                   "whose probabilities sum to P (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (temperature > 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate all --max-new-tokens even past the end-of-text token (a briefly trained model "
                        "often samples it early)")
    add_engine_flags(p.add_argument_group("engine (docs/serving.md lists every option)"), GENERATE)
    p.set_defaults(func=run_generate)


def use_compile_cache() -> None:
    """Send the engine's torch.compile artefacts (its compiled decoder steps) where
    training's go, the user's cache directory (duoka.cache), unless
    TORCHINDUCTOR_CACHE_DIR says otherwise: a second `duoka generate` or `duoka serve` of
    the model compiles little (on one H200, 0.5B's first token 3.3 s cold, 0.7 s warm).
    The engine's processes inherit it."""
    os.environ.update(compile_cache_env())


def run_generate(a: argparse.Namespace) -> int:
    use_compile_cache()
    from dataclasses import replace

    from duoka.serve.config import GENERATE, engine_config_from_args
    from duoka.serve.engine import LLMEngine
    from duoka.serve.params import SamplingParams
    params = SamplingParams(max_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, seed=a.seed, ignore_eos=a.ignore_eos)
    prompt = a.prompt
    if prompt is None and sys.stdin is not None and not sys.stdin.isatty():
        prompt = sys.stdin.read() or None
    if prompt is None:
        if a.model is not None or a.adapter is not None:
            raise DuokaError("no prompt given", 'pass --prompt "..." or pipe text on stdin')
        prompt = DEFAULT_PROMPT

    config = engine_config_from_args(a, GENERATE, max_num_seqs=1)  # one request: the smallest cache and graphs
    if config.adapter is not None:
        config = replace(config, model=_adapter_base(Path(config.adapter), config.model))
    engine = LLMEngine(config, log=log)
    if a.chat:
        messages = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": prompt}]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        ids = engine.tokenizer.encode(prompt)
    engine.add_request("generate", ids, params)
    out = sys.stdout
    stamps: list[float] = []  # when each token reached the host
    t1 = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            stamps.extend([time.perf_counter() - t1] * len(delta.new_token_ids))
            out.write(delta.new_text)
            out.flush()
    out.write("\n")
    out.flush()
    log(f"duoka: prompt {len(ids)} tokens, generated {len(stamps)} tokens in {stamps[-1]:.2f} s "
        f"(first token {stamps[0] * 1000:.0f} ms{_steady_rate(stamps)})")
    return 0


def _adapter_base(adapter_dir: Path, model: str | None) -> str:
    """The base model an adapter goes on: --model, else the one its adapter_config.json names."""
    from duoka.models.qwen2.peft import read_adapter

    base = model or read_adapter(adapter_dir).base
    if base is None:
        raise DuokaError(f"{adapter_dir / 'adapter_config.json'} names no base model (base_model_name_or_path)",
                         "give the base model with --model")
    log(f"duoka: adapter {adapter_dir} on {base}, merged at load")
    return base


def _steady_rate(stamps: list[float]) -> str:
    """Decode speed from the second decode step on: the first one pays CUDA warm-up and,
    with --compile, the compilation, which would hide the steady rate."""
    if len(stamps) < 4:
        return ""
    return f", decode {(len(stamps) - 2) / (stamps[-1] - stamps[1]):.1f} tokens/s"


# ---------------------------------------------------------------- serve

SERVE_API_KEY_ENV = "DUOKA_API_KEY"


def add_serve_parser(sub) -> None:
    from duoka.serve.config import (
        DEFAULT_GRACE_S,
        DEFAULT_HOST,
        DEFAULT_MAX_QUEUE,
        DEFAULT_PORT,
        SERVE,
        add_engine_flags,
    )

    p = add_command(sub, "serve", "deploy a model: an OpenAI-compatible HTTP API with continuous batching, on one or "
                                  "several GPUs (--tp)",
                    "Serve a Qwen2 model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics) with continuous batching and a paged KV cache. A request's "
                    "\"model\" names the served model as GET /v1/models lists it: the MODEL argument as given, or "
                    "--served-model-name. SIGTERM or Ctrl-C drains: in-flight requests finish, then exit 0.",
                    ("duoka serve   # the bundled model, named duoka-tiny-qwen2, on 127.0.0.1:8000",
                     "duoka serve runs/a/hf/step-1000 --tp 2",
                     "duoka serve Qwen/Qwen2.5-0.5B-Instruct --api-key \"$KEY\" --max-model-len 8192"))
    add_engine_flags(p.add_argument_group("engine (docs/serving.md lists every option)"), SERVE)
    server = p.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${SERVE_API_KEY_ENV}, else "
                             "none)")
    server.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait for admission before new ones get 503 "
                             f"(default {DEFAULT_MAX_QUEUE})")
    server.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help=f"seconds in-flight requests may finish after SIGTERM (default {DEFAULT_GRACE_S:g})")
    server.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                        help="CORS: the browser origins that may call the API, comma-separated "
                             "(https://app.example.com,http://localhost:3000), or * (default: none, no CORS headers)")
    server.add_argument("--log-requests", action="store_true", help="one log line per request: path, status, ms, id")
    p.set_defaults(func=run_serve)


def run_serve(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from duoka.launch.serving import launch_serving
    from duoka.serve.config import SERVE, ServerConfig, engine_config_from_args
    from duoka.serve.http_middleware import parse_origins

    use_compile_cache()

    config = engine_config_from_args(a, SERVE)  # refuses --tp 0, --gpu-memory-utilization 2, ...
    origins = parse_origins(a.allowed_origins)  # refused now, not once the model has loaded
    if config.adapter is not None:
        if config.tp > 1:  # the engine refuses it too, but only once every rank has started
            raise DuokaError(f"--adapter with --tp {config.tp}: the adapter is merged into whole weights, which "
                             "--tp splits over processes (not supported yet)",
                             f"merge it first: duoka export {config.adapter} --merge --out DIR, then duoka serve DIR "
                             f"--tp {config.tp}")
        config = replace(config, model=_adapter_base(Path(config.adapter), config.model),
                         served_model_name=config.served_model_name or config.adapter,
                         adapter=str(Path(config.adapter).resolve()))
    server = ServerConfig(host=a.host, port=a.port, api_key=a.api_key or os.environ.get(SERVE_API_KEY_ENV),
                          max_queue=a.max_queue, served_model_name=config.served_model_name, grace_s=a.grace,
                          allowed_origins=origins, log_requests=a.log_requests)
    return launch_serving(config, server, log=log)


# ---------------------------------------------------------------- train


def add_train_parser(sub) -> None:
    p = add_command(
        sub, "train", "train or fine-tune on this machine's GPUs (or its CPU), or on many nodes under Slurm or "
                      "Kubernetes (--slurm-script writes the batch job); no arguments: a one-minute demo on the "
                      "bundled corpus",
        "Train on every visible GPU (or one CPU process). Config: defaults < CFG.toml < --section.key=value "
        "overrides (every key: docs/config.md). Under Slurm (srun, one task per node) and in a Kubernetes "
        "Indexed Job or Kubeflow PyTorchJob the launch flags left out come from the scheduler's environment; see "
        "docs/cluster.md.",
        ("duoka train   # a one-minute demo on the bundled corpus",
         "duoka train cfg.toml --data.path=data.jsonl --optimizer.lr=1e-5",
         "duoka train cfg.toml --job.output_dir=runs/a --checkpoint.resume=auto"))
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--nproc-per-node", type=int, default=None, help="worker processes on this node "
                   "(default: one per selected GPU, or 1 without GPUs; with --slurm-script: GPUs per node)")
    p.add_argument("--nnodes", type=int, default=None, help="nodes in the job (default: the scheduler's count, else 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: the scheduler's, else 0)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 (c10d rendezvous; default under "
                   "Slurm: the first host of the job's node list)")
    p.add_argument("--gpus", default=None, help="nvidia-smi indices (0,3) or auto:N for the N least busy GPUs")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times after a "
                   "failure, each time from the newest intact checkpoint (as torchrun's flag)")
    p.add_argument("--slurm-script", metavar="FILE", default=None,
                   help="write an sbatch script that runs this command on --nnodes nodes (with --nproc-per-node "
                        "GPUs each; default: this machine's count), requeued after preemption and ahead of the "
                        "time limit, resuming its own run; then submit it with sbatch FILE")
    p.add_argument("--sbatch", metavar="OPTION", action="append", default=[],
                   help="with --slurm-script: one more #SBATCH line, e.g. --sbatch=--time=24:00:00 "
                        "--sbatch=--partition=gpu (repeatable)")
    p.set_defaults(func=run_train)


def run_train(a: argparse.Namespace) -> int:
    """Exit codes (docs/training.md, "Stopping, preemption and restarts"): 0 finished; 1 a
    worker died or crashed; 2 an error with its fix; 128 + N stopped by signal N (130 SIGINT,
    143 SIGTERM), with the command to continue; a worker's own code (75: a hang)."""
    from duoka.launch.cluster import LaunchFlags
    from duoka.launch.exits import TrainingStopped, WorkerFailed

    if a.sbatch and not a.slurm_script:
        raise DuokaError("--sbatch adds lines to the script --slurm-script writes", "add --slurm-script FILE")
    flags = LaunchFlags(a.nproc_per_node, a.nnodes, a.node_rank, a.rdzv_endpoint, a.gpus, a.max_restarts)
    if a.slurm_script:
        from duoka.launch.slurm_script import write_slurm_script

        write_slurm_script(a.slurm_script, a.config, a.overrides, flags, a.sbatch, log)
        return 0
    from duoka.launch.training import launch_training

    try:
        launch_training(a.config, a.overrides, flags, log=log)
    except TrainingStopped as e:
        log(f"duoka: {e}")
        return e.exit_code
    except WorkerFailed as e:
        print_error(e)
        return e.exit_code
    return 0


def add_prepare_parser(sub) -> None:
    p = add_command(sub, "prepare", "before training on a large corpus: tokenize it once into memory-mapped shards "
                                    "(then --data.path=OUT)",
                    "Text (.txt), JSONL (.jsonl, .jsonl.gz) or Parquet input, one shard per file, tokenized in "
                    "parallel. Resumable; a re-run on unchanged input does nothing. Train on the result with "
                    "--data.path=OUT.",
                    ("duoka prepare --data corpus/ --out tokens/ --tokenizer /models/Qwen2.5-0.5B",
                     "duoka train --model.path=/models/Qwen2.5-0.5B --data.path=tokens/"))
    p.add_argument("--data", required=True, help="a file or a folder of files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--tokenizer", default=None, help="folder or hub id with tokenizer.json "
                   "(default: the tokenizer bundled with duoka, the one `duoka train` uses for the debug model)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per core, at most one per file)")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="malformed records: count, report and skip them, or fail")
    p.set_defaults(func=run_prepare)


def run_prepare(a: argparse.Namespace) -> int:
    from duoka.data.prepare import prepare
    from duoka.hub import resolve_model_dir

    tokenizer = resolve_model_dir(a.tokenizer) if a.tokenizer else bundled_model_dir()
    prepare(Path(a.data), Path(a.out), tokenizer, a.text_field, a.workers, a.on_error, log=log,
            progress=sys.stderr.isatty())
    return 0


def add_export_parser(sub) -> None:
    p = add_command(sub, "export", "turn any training checkpoint into a Hugging Face folder (the final one is in "
                                   "RUN/hf/ already)",
                    "Convert RUN_DIR/checkpoints/step-N (torch.distributed.checkpoint, any layout) into config.json "
                    "+ safetensors + tokenizer files that transformers loads. The weights keep the dtype the "
                    "checkpoint stores them in (float32: duoka trains on fp32 master weights, bf16 runs too), as "
                    "RUN/hf/step-N does, unless --dtype says otherwise.",
                    ("duoka export runs/a/checkpoints/step-1000 --out hf_model/",
                     "duoka export runs/a/checkpoints/step-1000 --out hf16/ --dtype bfloat16",
                     "duoka export runs/lora/hf/step-800 --merge --out merged/"))
    p.add_argument("checkpoint", help="a checkpoints/step-N folder, or with --merge a LoRA adapter folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="of the whole model written (default auto: as stored, the checkpoint's dtype, or with "
                        "--merge the base model's; a LoRA adapter keeps its float32)")
    p.add_argument("--max-shard-size", default="5GB", help="the largest safetensors file; larger models are split "
                   "into files of at most this size with an index (default 5GB, as transformers)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA: write the base with the adapter merged in, as a whole model (default: the adapter, "
                        "in PEFT's format)")
    p.add_argument("--base", default=None,
                   help="with --merge: the base model's folder or hub id (default: the one the checkpoint or "
                        "adapter_config.json names)")
    p.add_argument("--skip-weight-check", dest="check_weights", action="store_false",
                   help="with --merge: load the base even if a weight holds NaN or infinity (refused by default)")
    p.add_argument("--trust-unverified", action="store_true",
                   help="export a checkpoint that has no manifest.json (saved by a duoka older than manifests): "
                        "its files cannot be checked for damage or changes")
    p.set_defaults(func=run_export)


def run_export(a: argparse.Namespace) -> int:
    from duoka.models.qwen2.peft import is_adapter_folder
    from duoka.train.export import export_checkpoint, merge_adapter_folder

    t = time.perf_counter()
    source = Path(a.checkpoint)
    if a.base is not None and not a.merge:
        raise DuokaError("--base is the base to merge into, and --merge is not given", "add --merge, or drop --base")
    if is_adapter_folder(source):
        if not a.merge:
            raise DuokaError(f"{source} is a LoRA adapter already (adapter_config.json)",
                             "add --merge to write its base with the adapter merged in")
        out = merge_adapter_folder(source, Path(a.out), a.dtype, a.max_shard_size, a.base, a.check_weights)
    else:
        out = export_checkpoint(source, Path(a.out), a.dtype, a.max_shard_size,
                                warn=lambda message: log(f"duoka: warning: {message}"), merge=a.merge,
                                base=a.base, trust_unverified=a.trust_unverified, check_weights=a.check_weights)
    log(f"duoka: exported {a.checkpoint} -> {out} ({_written(out)}) in {time.perf_counter() - t:.1f} s")
    print(out)
    return 0


def _written(folder: Path) -> str:
    """What an export wrote: the dtype of a whole model's weights, or a LoRA adapter."""
    from duoka.models.qwen2.hf_adapter import checkpoint_dtype
    from duoka.models.qwen2.peft import is_adapter_folder

    if is_adapter_folder(folder):
        return "a LoRA adapter in PEFT's format, float32"
    return str(checkpoint_dtype(folder)).removeprefix("torch.")


def add_plan_parser(sub) -> None:
    from duoka.plan.flags import PLAN_EXAMPLES, add_plan_flags

    p = add_command(sub, "plan", "before training: which parallel layout fits N GPUs and is fastest, memory per GPU, "
                                 "a ready config (--out)",
                    "Estimate per-GPU memory (weights, gradients, optimizer, activations, logits, buffers) for every "
                    "layout duoka runs, rank those that fit by estimated step time, explain the first and print a "
                    "config for it. Flags left out are read from this machine's GPUs. See docs/plan.md.",
                    PLAN_EXAMPLES)
    add_plan_flags(p)
    p.set_defaults(func=run_plan)


def run_plan(a: argparse.Namespace) -> int:
    import json

    from duoka.plan.hardware import detect_hardware
    from duoka.plan.model_choice import resolve_model
    from duoka.plan.ranking import make_plan
    from duoka.plan.render import render

    model = resolve_model(a.model)
    links = dict(network=a.network, inter_gbps=a.inter_bw,
                 intra_bytes_per_s=a.intra_bw * 1e9 if a.intra_bw is not None else None,
                 inter_step_s=a.inter_latency_us * 1e-6 if a.inter_latency_us is not None else None)
    if a.family and not a.scaling:
        raise DuokaError("--family picks the layouts of a --scaling table", "add --scaling, or drop --family")
    if a.scaling:
        if a.micro_batch is not None or a.activation_checkpointing is not None:
            raise DuokaError("--micro-batch and --activation-checkpointing pin one plan's choice, and --scaling "
                             "picks them at every size", "drop them, or drop --scaling")
        return run_plan_scaling(a, model, links)
    hw = detect_hardware(a.gpus, a.gpu_memory, a.nodes or 1, a.interconnect, host_memory_gib=a.host_memory, **links)
    ac = None if a.activation_checkpointing is None else a.activation_checkpointing == "full"
    plan = make_plan(model, hw, a.seq, a.global_batch, plan_optimizer(a), a.micro_batch, ac)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(plan.config_toml())
    if a.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        from rich.console import Console

        render(plan, Console(), a.top)
    if a.out:
        log(f"duoka: wrote {a.out}")
    return 0


def plan_optimizer(a: argparse.Namespace):
    """The optimizer `duoka plan` was asked to plan with; None lets it choose."""
    from duoka.plan.optimizer_costs import OptimizerChoice

    if a.sgd_momentum is not None and a.optimizer != "sgd":
        raise DuokaError("--sgd-momentum is the momentum of --optimizer sgd", "add --optimizer sgd, or drop it")
    if a.optimizer is None and a.offload is None:
        return None
    momentum = {} if a.sgd_momentum is None else {"sgd_momentum": a.sgd_momentum}
    return OptimizerChoice(a.optimizer or "adamw", a.offload or "none", **momentum)


def run_plan_scaling(a: argparse.Namespace, model, links: dict) -> int:
    import json

    from duoka.plan.hardware import detect_hardware
    from duoka.plan.optimizer_costs import ADAMW
    from duoka.plan.scaling import DEFAULT_SCALING_GPUS, plan_scaling, render_scaling, scaling_hardware

    if a.out:
        raise DuokaError("--out writes the config of one plan, and --scaling plans many sizes",
                         "drop --scaling to write the config for --gpus, or drop --out")
    gpus = a.gpus or DEFAULT_SCALING_GPUS
    hw = scaling_hardware(detect_hardware(gpus, a.gpu_memory, 1, a.interconnect, **links), gpus, a.nodes)
    result = plan_scaling(model, hw, a.seq, a.global_batch, a.scaling or "weak", a.family,
                          optimizer=plan_optimizer(a) or ADAMW)
    if a.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        from rich.console import Console

        render_scaling(result, Console())
    return 0


def add_monitor_parser(sub) -> None:
    p = add_command(sub, "monitor", "while a run trains: live loss, speed, MFU and per-GPU readings (from another "
                                    "terminal)",
                    "Follows RUN_DIR/metrics.jsonl: loss, speed, MFU, the step breakdown, one row per rank with its "
                    "GPU's readings, balance shares and alerts. --gpus adds this machine's GPUs like nvidia-smi, "
                    "labelled with the run's ranks. The tables fit the terminal's width (80 columns when piped): "
                    "columns without readings are left out, and the rest named below the table.",
                    ("duoka monitor runs/7b --gpus",
                     "duoka monitor runs/7b --once | tail -20   # one frame, e.g. from a script"))
    p.add_argument("run_dir", nargs="?", default=None, help="a duoka train job.output_dir")
    p.add_argument("--gpus", action="store_true", help="show this machine's GPUs (NVML)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes of the live view")
    p.set_defaults(func=run_monitor)


def run_monitor(a: argparse.Namespace) -> int:
    from rich.console import Console

    from duoka.monitor.dashboard import monitor

    if a.run_dir is None and not a.gpus:
        raise DuokaError("nothing to monitor", "give a run directory (duoka monitor runs/my-run) and/or --gpus")
    monitor(Path(a.run_dir) if a.run_dir else None, a.gpus, a.once, a.interval, Console())
    return 0


def add_report_parser(sub) -> None:
    p = add_command(sub, "report", "after (or during) a run: one HTML page of plots and alerts to keep or share",
                    "Write RUN_DIR/report.html: loss, throughput, MFU, the step breakdown, per-GPU utilisation and "
                    "memory, balance shares, alerts and the config, as inline SVG (opens from disk, no server, no "
                    "network).",
                    ("duoka report runs/7b   # writes runs/7b/report.html",))
    p.add_argument("run_dir", help="a duoka train job.output_dir")
    p.add_argument("--out", default=None, help="default: RUN_DIR/report.html")
    p.set_defaults(func=run_report)


def run_report(a: argparse.Namespace) -> int:
    from duoka.monitor.report import write_report

    out = write_report(Path(a.run_dir), Path(a.out) if a.out else None)
    log(f"duoka: wrote {out}")
    return 0


def add_doctor_parser(sub) -> None:
    p = add_command(sub, "doctor", "first thing on a new machine, or after a failure: driver, GPUs, NCCL, links, "
                                   "with fixes; --explain LOG",
                    "Checks Python, PyTorch against the driver, the GPUs (busy, ECC, throttling), memory for --model, "
                    "CPU/RAM/shm, NCCL, GPU links, InfiniBand, risky NCCL variables, the rendezvous port and disk. "
                    "Exit code 0: all pass, 1: warnings, 2: failures. --explain reads a log and names the known "
                    "failure in it.",
                    ("duoka doctor --model qwen2-7b --bench",
                     "duoka doctor --explain runs/7b/train.log"))
    p.add_argument("--model", default=None, help="a flavor or model folder: does it fit these GPUs? (duoka plan)")
    p.add_argument("--bench", action="store_true", help="also measure matmul TFLOP/s, copy and all-reduce bandwidth")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port to check")
    p.add_argument("--disk", default=".", help="where checkpoints will go (free space)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--explain", default=None, metavar="LOGFILE",
                   help="diagnose a failed run's log ('-' for stdin): exit 0 if a known failure was found, "
                        "1 if nothing in it is known")
    p.set_defaults(func=run_doctor)


def run_doctor(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    console = Console(stderr=a.json)
    if a.explain is not None:
        from duoka.doctor.diagnose import explain

        if a.explain == "-":
            text = sys.stdin.read()
        elif not Path(a.explain).is_file():
            raise DuokaError(f"log file {a.explain} not found", "pass the path of a log, or - to read stdin")
        else:
            text = Path(a.explain).read_text(errors="replace")
        found = explain(text)
        if a.json:
            print(json.dumps([vars(d) for d in found], indent=1))
        elif not found:
            console.print("No known failure found in this log. duoka recognises NCCL timeouts, port clashes, "
                          "driver/CUDA mismatches, out-of-memory, /dev/shm exhaustion, GPU-order mistakes, "
                          "tensor-parallel head counts and missing tokenizer files; the error may be elsewhere "
                          "(look for the first traceback of the first failing rank).")
        from rich.markup import escape  # log lines are full of [rank0]: and [/dev/shm]: never markup

        for d in found if not a.json else []:
            console.print(f"[bold red]{d.kind}[/]: {escape(d.cause)}\n  [bold]fix[/]: {escape(d.fix)}\n"
                          f"  [dim]from: {escape(d.evidence)}[/]")
        return 0 if found else 1

    from duoka.doctor.checks import exit_code, gather, render, run_checks

    facts = gather(a.port, a.disk)
    results = run_checks(facts, a.model)
    bench = None
    if a.bench:  # imported here: it imports torch
        from duoka.doctor.bandwidth import render_bench, run_bench

        bench = run_bench(len(facts.gpus))
    if a.json:
        print(json.dumps({"results": [r.to_dict() for r in results], "bench": bench,
                          "exit_code": exit_code(results)}, indent=1))
    else:
        render(results, console)
        if bench:
            render_bench(bench, console)
    return exit_code(results)


def add_bench_parser(sub) -> None:
    from duoka.bench.flags import BENCH_EXAMPLES, add_bench_flags

    p = add_command(sub, "bench", "measure training speed (tokens/s/GPU, MFU, memory), or with `bench serve` a "
                                  "server's throughput and latency; optionally vs transformers",
                    "Runs duoka train on random tokens for warm-up + timed steps on the visible GPUs (or CPU "
                    "processes) and reports tokens/s/GPU, MFU, peak memory and the step-time breakdown, with a "
                    "progress line per step. `duoka bench serve` measures serving instead.",
                    BENCH_EXAMPLES)
    add_bench_flags(p)
    p.set_defaults(func=run_bench)
    modes = p.add_subparsers(dest="bench_mode", metavar="[serve]")  # none: training, as before
    add_bench_serve_parser(modes)


def run_bench(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from duoka.bench.training import TRAIN_PEER, bench, render, repository_peer, stop_process_groups_on_signal

    stop_process_groups_on_signal()  # a stopped `duoka bench` takes its training workers with it
    result = bench(a.model, a.layout, a.seq, a.micro_batch, a.steps, a.warmup, a.global_batch, a.vs_peer,
                   Path(a.peer) if a.peer else repository_peer(TRAIN_PEER), a.nproc_per_node, a.timeout, a.set,
                   a.profile, log=log)
    render(result, Console(stderr=True))
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
        log(f"duoka: wrote {a.out}")
    else:
        print(text)
    return 0


def add_bench_serve_parser(sub) -> None:
    from duoka.bench.flags import BENCH_SERVE_EXAMPLES, add_bench_serve_flags

    p = add_command(
        sub, "serve", "measure a server's throughput and latency (TTFT, TPOT, ITL) through the OpenAI API, "
                      "optionally vs transformers",
        "Sends a fixed workload through a server's OpenAI API (/v1/completions, streamed, ignore_eos) and reports "
        "request and token throughput, time to first token, time per output token and inter-token latency (mean, "
        "median, p99), as `vllm bench serve` does, with progress lines as requests finish. The server is the one "
        "at --url, or a `duoka serve` started here from --model and stopped at the end.",
        BENCH_SERVE_EXAMPLES)
    add_bench_serve_flags(p, SERVE_API_KEY_ENV)
    p.set_defaults(func=run_bench_serve)


def run_bench_serve(a: argparse.Namespace) -> int:
    import json
    import shlex

    from rich.console import Console

    from duoka.bench.serving import ServeBenchOptions, bench_serve, default_result_path, render

    # The command as typed (`duoka` for the interpreter and script path); in-process callers get their argv.
    argv = sys.argv[1:]
    command = shlex.join(["duoka", *argv] if argv[:2] == ["bench", "serve"] else sys.argv)
    o = ServeBenchOptions(
        model=a.model, url=a.url, model_name=a.model_name, api_key=a.api_key or os.environ.get(SERVE_API_KEY_ENV),
        serve_args=[x for arg in a.serve_arg for x in shlex.split(arg)], requests=a.requests,
        prompt_min=a.prompt_min, prompt_max=a.prompt_max, out_len=a.out_len, seed=a.seed, vocab=a.vocab,
        prompts=a.prompts, concurrency=a.concurrency, request_rate=a.request_rate, duration_s=a.duration,
        warmup=a.warmup, batch1=a.batch1, vs_peer=a.vs_peer, peer=Path(a.peer) if a.peer else None,
        peer_model=a.peer_model, peer_timeout_s=a.peer_timeout, start_timeout_s=a.start_timeout, command=command)
    result = bench_serve(o, log=log)
    render(result, Console(stderr=True))
    text = json.dumps(result, indent=1)
    if a.out is not None:
        out = Path(a.out) if a.out else default_result_path(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        log(f"duoka: wrote {out}")
    else:
        print(text)
    return 1 if a.vs_peer and result["vs_peer"] is None else 0  # the comparison asked for did not happen


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="duoka", description="Train and serve Qwen2-family models on many GPUs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="first run: duoka train   (a one-minute demo; it ends with a command to try)\n"
               "on GPUs:   duoka plan --model Qwen/Qwen2.5-7B --out 7b.toml\n"
               "           duoka train 7b.toml --data.path=data.jsonl --optimizer.lr=1e-5\n"
               "           duoka monitor RUN_DIR --gpus   (the run directory it names)\n"
               "more:      duoka COMMAND --help; README.md")
    parser.add_argument("--version", action="version", version=f"duoka {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # In the order a new user meets them: check, plan, train, watch, use the result, measure.
    add_doctor_parser(sub)
    add_plan_parser(sub)
    add_prepare_parser(sub)
    add_train_parser(sub)
    add_monitor_parser(sub)
    add_report_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP here or in a worker: threads waiting at a barrier sleep rather
    # than spin. Beside other CPU-bound work, spinning threads took the cores from the threads
    # they waited for (the default CPU run: 47 s alone, ~10x beside two busy processes); alone
    # it costs ~12% on an idle 2-core machine (bench/NOTES.md 29). The user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    try:
        args = parse_command_line(parser, list(sys.argv[1:] if argv is None else argv))
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return 2
        return args.func(args)
    except DuokaError as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `duoka generate ... | head` closed the pipe: not an error
        return 0
    except OSError as e:  # a read-only or full output folder: one message; other OSErrors are bugs
        if (error := file_error(e)) is None:
            raise
        print_error(error)
        return 2


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The flags, with `duoka train`'s --section.key=value overrides set apart (args.overrides);
    a flag the command does not know is one error naming it and what to write instead."""
    overrides: list[str] = []
    if argv and argv[0] == "train":
        argv, overrides = split_overrides(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise unknown_argument(args, unknown, argv)
    args.overrides = overrides
    return args


def unknown_argument(args: argparse.Namespace, unknown: list[str], argv: list[str]) -> DuokaError:
    """The error for arguments a command does not take: for `duoka train`, the config key a
    flag most likely means (--lr -> --optimizer.lr), else the command's closest flag."""
    usage = getattr(args, "command_parser", None)
    command = usage.prog if usage is not None else "duoka"
    flag = next((u for u in unknown if u.startswith("-")), None)
    if flag is None:
        return DuokaError(f"unexpected argument {unknown[0]!r}", f"`{command} --help` lists what {command} takes")
    name, _, value = flag.lstrip("-").partition("=")
    following = argv[argv.index(flag) + 1:argv.index(flag) + 2]  # --lr 1e-3: argparse took 1e-3 as a positional
    value = value or (following[0] if following and not following[0].startswith("-") else "VALUE")
    if getattr(args, "command", None) == "train":
        key = suggest_key(name)
        example = f"--{key}={value}" if key else "--optimizer.lr=1e-3 (docs/config.md lists every key)"
        return DuokaError(f"unknown flag --{name}", f"pass config keys as --section.key=value, e.g. {example}")
    known = set(re.findall(r"--([\w-]+)", usage.format_help())) if usage is not None else set()
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"did you mean --{close[0]}? " if close else ""
    return DuokaError(f"unknown flag --{name}", f"{hint}`{command} --help` lists the flags, each with its default")


def print_error(e: DuokaError) -> None:
    print(f"error: {e.cause}", file=sys.stderr)
    if e.fix:
        print(f"  fix: {e.fix}", file=sys.stderr)


def run() -> None:
    """The `duoka` command: main(), then a quick exit that skips only the interpreter's
    teardown of torch's modules (runtime.exit_now). An exception leaves the normal way,
    traceback and all."""
    runtime.exit_now(main())


if __name__ == "__main__":
    run()
