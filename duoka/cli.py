"""The `duoka` command. Subcommands are thin: they parse flags and call the library.

User errors (DuokaError) end in two lines, the cause and the fix, and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from duoka import __version__, runtime
from duoka.cache import compile_cache_env
from duoka.errors import DuokaError, file_error
from duoka.hub import bundled_model_dir

DEFAULT_PROMPT = "Return the"  # the bundled model read only standard-library docstrings


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- generate


def add_generate_parser(sub) -> None:
    from duoka.serve.config import GENERATE, add_engine_flags

    p = sub.add_parser("generate", help="try a model on one prompt: a run's hf/step-N, a hub id or a folder; the "
                                        "text streams to stdout",
                       description="Generate a continuation of PROMPT on the serving engine (the one under `duoka "
                                   "serve`). Only the generated text goes to stdout; load and speed figures go to "
                                   "stderr.")
    p.add_argument("--prompt", default=None, help="prompt text (default: read stdin when it is not a terminal)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
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

    p = sub.add_parser("serve", help="deploy a model: an OpenAI-compatible HTTP API with continuous batching, on "
                                     "one or several GPUs (--tp)",
                       description="Serve a Qwen2 model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                   "/v1/completions, /v1/models, /health, /metrics) with continuous batching and a "
                                   "paged KV cache. SIGTERM or Ctrl-C drains: in-flight requests finish, then exit 0.")
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
    p = sub.add_parser(
        "train", help="train or fine-tune on this machine's GPUs (or its CPU), or on many nodes under Slurm or "
                      "Kubernetes (--slurm-script writes the batch job); no arguments: a one-minute demo on the "
                      "bundled corpus",
        description="Train on every visible GPU (or one CPU process). Config: defaults < CFG.toml < "
                    "--section.key=value overrides; see docs/config.md. Under Slurm (srun, one task per node) "
                    "and in a Kubernetes Indexed Job or Kubeflow PyTorchJob the launch flags left out come from "
                    "the scheduler's environment; see docs/cluster.md.")
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
    p = sub.add_parser("prepare", help="before training on a large corpus: tokenize it once into memory-mapped "
                                       "shards (then --data.path=OUT)",
                       description="Text (.txt), JSONL (.jsonl, .jsonl.gz) or Parquet input, one shard per file, "
                                   "tokenized in parallel. Resumable; a re-run on unchanged input does nothing. "
                                   "Train on the result with --data.path=OUT.")
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
    p = sub.add_parser("export", help="turn any training checkpoint into a Hugging Face folder (the final one is "
                                      "in RUN/hf/ already)",
                       description="Convert RUN_DIR/checkpoints/step-N (torch.distributed.checkpoint, any layout) "
                                   "into config.json + safetensors + tokenizer files that transformers loads.")
    p.add_argument("checkpoint", help="a checkpoints/step-N folder, or with --merge a LoRA adapter folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="of the whole model written (a LoRA adapter keeps its fp32)")
    p.add_argument("--max-shard-size", default="5GB")
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
    log(f"duoka: exported {a.checkpoint} -> {out} in {time.perf_counter() - t:.1f} s")
    print(out)
    return 0


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="before training: which parallel layout fits N GPUs and is fastest, memory per "
                                    "GPU, a ready config (--out)",
                       description="Estimate per-GPU memory (weights, gradients, optimizer, activations, logits, "
                                   "buffers) for every layout duoka runs, rank those that fit by estimated step "
                                   "time, explain the first and print a config for it. Flags left out are read "
                                   "from this machine's GPUs. See docs/plan.md.")
    p.add_argument("--model", required=True, help="flavor (qwen2-7b, or 7b for short) or a Hugging Face folder / hub id")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the whole job, all nodes together "
                   "(default: this node's visible GPUs x --nodes)")
    p.add_argument("--nodes", type=int, default=None, help="nodes the GPUs are spread over (default 1; with "
                   "--scaling, nodes of 8)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory of one GPU in GiB (default: read from this machine's GPUs)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048, or the model's "
                   "context when shorter)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default 8 per GPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="plan only with this micro-batch (default: every "
                   "power of two dividing the per-GPU batch)")
    p.add_argument("--activation-checkpointing", choices=("none", "full"), default=None,
                   help="plan only with (full) or without (none) checkpointing (default: both)")
    from dataclasses import fields

    from duoka.config import OptimizerConfig  # not duoka.plan.optimizer_costs: `duoka --help` loads no torch

    choices = {f.name: f.metadata["choices"] for f in fields(OptimizerConfig)}
    p.add_argument("--optimizer", choices=choices["name"], default=None,
                   help="optimizer.name to plan with (default adamw; when AdamW fits nowhere, the plan proposes one "
                        "that fits)")
    p.add_argument("--offload", choices=choices["offload"], default=None,
                   help="optimizer.offload: cpu puts AdamW's state and step on the host (one GPU; default none)")
    p.add_argument("--sgd-momentum", type=float, default=None,
                   help="optimizer.sgd_momentum with --optimizer sgd (0: no momentum buffer; default 0.9)")
    p.add_argument("--host-memory", type=float, default=None, metavar="GiB",
                   help="host RAM per GPU, the limit of an offloaded optimizer (default: this machine's RAM per GPU "
                        "when its GPUs are planned for, else unchecked)")
    p.add_argument("--interconnect", choices=("nvlink", "pcie", "ib"), default=None,
                   help="link between the GPUs of one node (default: detected, else nvlink); ib: none but the NIC")
    from duoka.plan.network import DEFAULT_NETWORK, NETWORKS

    p.add_argument("--network", choices=tuple(NETWORKS), default=None,
                   help=f"the network between nodes (default {DEFAULT_NETWORK}): ib-ndr/ib-hdr/roce-400/roce-200 a "
                        "NIC of 400/200 Gb/s per GPU with RDMA; eth-400/200/100 one NIC per node, TCP")
    p.add_argument("--intra-bw", type=float, default=None, metavar="GB/s",
                   help="bus bandwidth per GPU inside a node, as nccl-tests reports it (default: 350 nvlink, 25 pcie)")
    p.add_argument("--inter-bw", type=float, default=None, metavar="Gb/s",
                   help="NIC line rate per GPU across nodes (default: the --network's; e.g. one 100 Gb/s NIC shared "
                        "by 8 GPUs is 12.5)")
    p.add_argument("--inter-latency-us", type=float, default=None, metavar="us",
                   help="one ring step across nodes (default 9.6, NCCL's figure for RDMA networks)")
    p.add_argument("--scaling", nargs="?", const="weak", default=None, choices=("weak", "strong"),
                   help="a table from one node to --gpus (default 1024): step time, tokens/s per GPU, efficiency "
                        "and the largest overhead per size; weak (default): batch per GPU fixed, strong: global "
                        "batch fixed")
    p.add_argument("--family", choices=("ddp", "fsdp", "hsdp", "tp", "pp"), default=None,
                   help="with --scaling: only layouts of this family at every size (default: the plan's first)")
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON instead of tables")
    p.add_argument("--out", default=None, help="write the recommended config to this TOML file")
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
    p = sub.add_parser("monitor", help="while a run trains: live loss, speed, MFU and per-GPU readings (from "
                                       "another terminal)",
                       description="Follows RUN_DIR/metrics.jsonl: loss, speed, MFU, the step breakdown, one row "
                                   "per rank with its GPU's readings, balance shares and alerts. --gpus adds this "
                                   "machine's GPUs like nvidia-smi, labelled with the run's ranks.")
    p.add_argument("run_dir", nargs="?", default=None, help="a duoka train job.output_dir")
    p.add_argument("--gpus", action="store_true", help="show this machine's GPUs (NVML)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.set_defaults(func=run_monitor)


def run_monitor(a: argparse.Namespace) -> int:
    from rich.console import Console

    from duoka.monitor.dashboard import monitor

    if a.run_dir is None and not a.gpus:
        raise DuokaError("nothing to monitor", "give a run directory (duoka monitor runs/my-run) and/or --gpus")
    monitor(Path(a.run_dir) if a.run_dir else None, a.gpus, a.once, a.interval, Console())
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="after (or during) a run: one HTML page of plots and alerts to keep or share",
                       description="Write RUN_DIR/report.html: loss, throughput, MFU, the step breakdown, per-GPU "
                                   "utilisation and memory, balance shares, alerts and the config, as inline SVG "
                                   "(opens from disk, no server, no network).")
    p.add_argument("run_dir", help="a duoka train job.output_dir")
    p.add_argument("--out", default=None, help="default: RUN_DIR/report.html")
    p.set_defaults(func=run_report)


def run_report(a: argparse.Namespace) -> int:
    from duoka.monitor.report import write_report

    out = write_report(Path(a.run_dir), Path(a.out) if a.out else None)
    log(f"duoka: wrote {out}")
    return 0


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="first thing on a new machine, or after a failure: driver, GPUs, NCCL, links, "
                                      "with fixes; --explain LOG",
                       description="Checks Python, PyTorch against the driver, the GPUs (busy, ECC, throttling), "
                                   "memory for --model, CPU/RAM/shm, NCCL, GPU links, InfiniBand, risky NCCL "
                                   "variables, the rendezvous port and disk. Exit code 0: all pass, 1: warnings, "
                                   "2: failures. --explain reads a log and names the known failure in it.")
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
    if a.bench:
        from duoka.doctor.bandwidth import run_bench

        bench = run_bench(len(facts.gpus))
    if a.json:
        print(json.dumps({"results": [r.to_dict() for r in results], "bench": bench,
                          "exit_code": exit_code(results)}, indent=1))
    else:
        render(results, console)
        if bench:
            _render_bench(bench, console)
    return exit_code(results)


def _render_bench(bench: dict, console) -> None:
    if "matmul_tflops" in bench:
        for i, (t, c) in enumerate(zip(bench["matmul_tflops"], bench["copy_gbps"])):
            console.print(f"GPU {i}: bf16 matmul {t:.0f} TFLOP/s, host->device {c['host_to_device']:.1f} GB/s, "
                          f"device->host {c['device_to_host']:.1f} GB/s")
        console.print(f"static load-balance weights: --parallel.balance_weights={bench['balance_weights']}")
    else:
        console.print(f"CPU mode: fp32 matmul {bench['cpu_matmul_tflops'] * 1e3:.0f} GFLOP/s")
    for row in bench.get("allreduce") or bench.get("allreduce_gloo_cpu") or []:
        console.print(f"all-reduce {row['bytes'] / 2**20:8.0f} MiB: algbw {row['algbw_gbps']:7.1f} GB/s, "
                      f"busbw {row['busbw_gbps']:7.1f} GB/s")


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure training speed (tokens/s/GPU, MFU, memory), or with `bench serve` "
                                     "a server's throughput and latency; optionally vs transformers",
                       description="Runs duoka train on random tokens for warm-up + timed steps on the visible "
                                   "GPUs and reports tokens/s/GPU, MFU, peak memory and the step-time breakdown. "
                                   "`duoka bench serve` measures serving instead.")
    p.add_argument("--model", default="qwen2-0.5b", help="flavor (qwen2-0.5b, qwen2-1.5b, qwen2-7b, ...)")
    p.add_argument("--layout", default="ddp", help="parts joined by +: ddp | fsdp | hsdpR | tpN | ppN | ac | compile "
                                                   "| fused | reduce-every | noreshard")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--global-batch", type=int, default=None, help="default: micro-batch x data-parallel ranks")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: one per visible GPU")
    p.add_argument("--vs-peer", action="store_true", help="also run the transformers peer in this call")
    p.add_argument("--peer", default=None,
                   help="peer script (default: the repository's bench/peers/train_peer.py; an installed duoka "
                        "has no bench/, so give a copy of it here)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra duoka train setting, e.g. --set parallel.reshard_after_forward=false (repeatable)")
    p.add_argument("--profile", action="store_true",
                   help="profile the last warm-up step; the top kernels by device time go into the JSON")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=run_bench)
    modes = p.add_subparsers(dest="bench_mode", metavar="[serve]")  # none: training, as before
    add_bench_serve_parser(modes)


def run_bench(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from duoka.bench.training import DEFAULT_PEER, bench, render, stop_process_groups_on_signal

    stop_process_groups_on_signal()  # a stopped `duoka bench` takes its training workers with it
    result = bench(a.model, a.layout, a.seq, a.micro_batch, a.steps, a.warmup, a.global_batch, a.vs_peer,
                   Path(a.peer) if a.peer else DEFAULT_PEER, a.nproc_per_node, a.timeout, a.set, a.profile)
    render(result, Console(stderr=True))
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
        log(f"duoka: wrote {a.out}")
    else:
        print(text)
    return 0


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="measure a server's throughput and latency (TTFT, TPOT, ITL) through the OpenAI API, "
                      "optionally vs transformers",
        description="Sends a fixed workload through a server's OpenAI API (/v1/completions, streamed, ignore_eos) "
                    "and reports request and token throughput, time to first token, time per output token and "
                    "inter-token latency (mean, median, p99), as `vllm bench serve` does. The server is the one "
                    "at --url, or a `duoka serve` started here from --model and stopped at the end.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=None,
                       help="start `duoka serve MODEL` (folder or hub id; default: the bundled tiny model)")
    where.add_argument("--url", default=None, help="benchmark the server running at this base URL instead")
    p.add_argument("--model-name", default=None, help="the model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help=f"bearer key for the server (default: ${SERVE_API_KEY_ENV})")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARGS",
                   help='extra flags for the duoka serve started here, e.g. --serve-arg "--device cpu" or '
                        "--serve-arg=--enforce-eager (repeatable)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests to send (default 256, or every line of --prompts)")
    p.add_argument("--prompt-min", type=int, default=128, help="shortest random prompt in tokens (default 128)")
    p.add_argument("--prompt-max", type=int, default=1024, help="longest random prompt in tokens (default 1024)")
    p.add_argument("--out-len", type=int, default=256, help="output tokens per request (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default 0, the peer's)")
    p.add_argument("--vocab", type=int, default=None,
                   help="draw prompt ids from [1, VOCAB) (default: the model's vocab_size)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='send these prompts instead: one {"prompt": text or token ids} per line')
    p.add_argument("--concurrency", type=int, default=None, help="at most N requests in flight (default: all)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at R requests/s (seeded) instead of all at once")
    p.add_argument("--duration", type=float, default=None,
                   help="with --request-rate: send what arrives in this many seconds")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first (default 1)")
    p.add_argument("--batch1", action="store_true",
                   help="also one streamed request alone (128-token prompt): decode tokens/s, from the "
                        "difference of --out-len tokens and a quarter of them (prefill cancels out)")
    p.add_argument("--vs-peer", action="store_true",
                   help="also run the transformers peer on the same prompts, once the server is stopped")
    p.add_argument("--peer", default=None,
                   help="peer script (default: the repository's bench/peers/serve_peer.py; an installed duoka "
                        "has no bench/, so give a copy of it here)")
    p.add_argument("--peer-model", default=None, help="the peer's shape: 0.5b, 1.5b or 7b (default: from the model)")
    p.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds for the peer run (default 1800)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds the started server may take to be ready (default 900)")
    p.add_argument("--out", nargs="?", const="", default=None, metavar="FILE",
                   help="write the JSON result to FILE (no FILE: bench/results/serve/<model>-<load>-<time>.json); "
                        "default: stdout")
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


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Take `--section.key=value` / `--section.key value` out before argparse sees them
    (a dotted flag name is an override; its section is checked by the config)."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg[2:].split("=", 1)[0]:
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                overrides.append(argv[i + 1])
                i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if argv and argv[0] == "train":
        argv, overrides = split_overrides(argv)
    args = parser.parse_args(argv)
    args.overrides = overrides
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
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
