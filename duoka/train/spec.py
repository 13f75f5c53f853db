"""The run as the launcher resolves it (resolve_run, then resolve_resume once the run
directory is held): one frozen, picklable value handed to every worker.

Everything that can be decided without a device is decided once, before any worker starts,
and checked there (layout, batch arithmetic, FSDP2 units, pipeline stage sizes, the resume
point, float8 eligibility). A worker keeps only what needs its own device: the `auto`
compute dtype and kernels, and an `auto` micro-batch (with the FSDP2 unit size that
follows from it). Workers never write into the config.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

from duoka.config import Config
from duoka.data.dataset import RANDOM_DATA, PackedWindows, end_of_text_id, read_manifest, tokenize_corpus
from duoka.data.prepare import is_prepared
from duoka.data.sft import prepare_sft
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError
from duoka.hub import bundled_corpus, bundled_model_dir, resolve_model_dir
from duoka.models.qwen2.args import BUNDLED_TOKENIZER_FLAVORS, FLAVORS, ModelArgs, get_flavor
from duoka.models.qwen2.hf_adapter import read_config, weight_files
from duoka.models.qwen2.stages import layer_counts
from duoka.parallel.dims import ParallelDims
from duoka.parallel.parallelize import check_float8
from duoka.plan.memory import auto_blocks_per_unit
from duoka.train import adapters
from duoka.train.batch_plan import pipeline_microbatches, plan_batch
from duoka.train.checkpoint_io import find_resume_checkpoint, read_train_state
from duoka.train.compile_check import failing_ranks
from duoka.train.load_balance import check_config as check_balance_config
from duoka.train.optimizers import check_optimizer
from duoka.train.optimizers import check_resume as check_optimizer_resume
from duoka.train.run_files import tokenizer_files


@dataclass(frozen=True)
class RunSpec:
    config: dict  # Config.to_dict() of the resolved config (read with .cfg; never written)
    run_dir: str
    model_args: dict  # asdict(ModelArgs)
    world_size: int
    model_dir: str | None  # HF folder to load weights from, None for random init
    token_file: str | None  # cached token ids, None for random data
    tokenizer_files: tuple[str, ...]
    end_of_text: int | None  # the id between packed documents
    resume_from: str | None  # a complete checkpoint folder
    resume_step: int  # its step (0 without one)
    micro_batch: int | None  # None: `auto`, sized by each worker from its free GPU memory
    fsdp_blocks_per_unit: int | None  # None: sized by the worker with an auto micro-batch
    stage_layers: tuple[int, ...] | None  # decoder layers per pipeline stage; None: measured, or no pipeline
    base: dict | None = None  # LoRA runs: the frozen base's identity (duoka.train.adapters.base_identity)

    @cached_property
    def cfg(self) -> Config:
        return Config.from_dict(self.config)


Log = Callable[[str], None]


def resolve_run(cfg: Config, world: int, on_gpu: bool, log: Log) -> RunSpec:
    """Everything a worker would otherwise discover late, resolved and checked once: the model,
    the layout against `world` processes, the batch arithmetic, the data (tokenized here).
    The run directory and the resume point come later, from resolve_resume."""
    args, model_dir, tokenizer_dir = resolve_model(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.check_model(args.n_heads, args.n_kv_heads, args.n_layers, cfg.parallel.pp_stages_per_rank, args.num_experts)
    check_balance_config(cfg.parallel, cfg.debug, dims.model_parallel, dims.tp, dims.pp, dims.dp_size, world)
    check_float8(cfg.training.float8, dims.tp)
    check_moe_layout(cfg, dims, args)
    lora = adapters.lora_args(cfg)
    adapters.check_layout(cfg, dims, args)
    check_optimizer(cfg, dims, on_gpu=on_gpu, lora=lora is not None)
    if lora is not None and model_dir is None:
        log("duoka: warning: LoRA on a randomly initialised base (model.path is empty): right for measurements, "
            "but the adapter means nothing outside this run; set model.path to fine-tune a real model")
    failing_ranks(cfg.debug.fail_compile_ranks, world)
    micro_batch, blocks_per_unit, stage_layers = _batch_layout(cfg, args, dims)
    if cfg.training.seq_len % (2 * dims.cp):
        raise DuokaError(f"training.seq_len={cfg.training.seq_len} does not cut into 2 x parallel.cp = {2 * dims.cp} "
                         "equal chunks (each cp rank holds two, one from each end, to balance causal attention)",
                         f"use a training.seq_len that is a multiple of {2 * dims.cp}")
    if cfg.training.seq_len > args.context_len:
        raise DuokaError(f"training.seq_len={cfg.training.seq_len} exceeds the model's {args.context_len} positions",
                         f"use training.seq_len <= {args.context_len}, or a config.json whose rope_scaling extends "
                         "the context (Qwen's YaRN: {\"type\": \"yarn\", \"factor\": 4.0, "
                         "\"original_max_position_embeddings\": 32768} for 131072)")
    token_file, files, end_of_text = resolve_data(cfg, args, tokenizer_dir, log)
    base = adapters.base_identity(model_dir, args, cfg.training.seed) if lora is not None else None
    return RunSpec(config=cfg.to_dict(), run_dir="", model_args=asdict(args), world_size=world,
                   model_dir=str(model_dir) if model_dir else None, token_file=token_file,
                   tokenizer_files=tuple(files), end_of_text=end_of_text, resume_from=None, resume_step=0,
                   micro_batch=micro_batch, fsdp_blocks_per_unit=blocks_per_unit, stage_layers=stage_layers,
                   base=base)


def check_moe_layout(cfg: Config, dims: ParallelDims, args: ModelArgs) -> None:
    """What a mixture-of-experts model does not train with yet: tensor and pipeline
    parallelism (no plan for the sparse layers; the load-balancing loss spans every layer),
    float8, LoRA, and compiled blocks under expert parallelism."""
    if not args.num_experts:
        return
    name = cfg.model.path or cfg.model.flavor
    refusals = [
        (dims.tp > 1, f"parallel.tp={dims.tp}", "train it with data parallelism (FSDP2 or DDP): set parallel.tp=1"),
        (dims.pp > 1, f"parallel.pp={dims.pp}", "train it with data parallelism (FSDP2 or DDP): set parallel.pp=1"),
        (cfg.training.float8 != "none", f"training.float8={cfg.training.float8}", "set training.float8=none"),
        (cfg.lora.rank > 0, f"LoRA (lora.rank={cfg.lora.rank})", "set lora.rank=0: train the whole model"),
        (dims.cp > 1, f"parallel.cp={dims.cp} (the router's load-balancing loss is a function of the routing of "
         "whole sequences, not of a rank's chunks)", "set parallel.cp=1, or train a dense model"),
        (dims.ep > 1 and cfg.training.compile is True, f"training.compile=true and parallel.ep={dims.ep} (the "
         "token dispatch reads the all-to-all's sizes on the host, which a block compiled as one graph cannot hold)",
         "set training.compile=auto (off under expert parallelism) or parallel.ep=1"),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise DuokaError(f"{name} is a mixture-of-experts model, which does not train with {what} yet", fix)


def resolve_model(cfg: Config) -> tuple[ModelArgs, Path | None, Path | None]:
    """(ModelArgs, folder to load weights from or None, tokenizer folder or None)."""
    if cfg.model.path:
        folder = resolve_model_dir(cfg.model.path)
        args = read_config(folder)
        weight_files(folder)  # fails now, not in every worker, if the weights are missing
        tokenizer = Path(cfg.model.tokenizer) if cfg.model.tokenizer else folder
        return args, folder, tokenizer
    args = get_flavor(cfg.model.flavor)
    if cfg.model.tokenizer:
        return args, None, resolve_model_dir(cfg.model.tokenizer)
    if any(args is FLAVORS[name] for name in BUNDLED_TOKENIZER_FLAVORS):  # also under a shorthand name
        return args, None, bundled_model_dir()
    return args, None, None


def _batch_layout(cfg: Config, args: ModelArgs, dims: ParallelDims) -> tuple[int | None, int | None, tuple | None]:
    """(micro-batch, FSDP2 blocks per unit, layers per pipeline stage), each None where a
    worker decides it (an `auto` micro-batch is sized from the worker's free GPU memory)."""
    stage_layers = None
    if dims.pp > 1 and cfg.parallel.pp_layers != "measured":
        stage_layers = tuple(layer_counts(args, dims.pp * cfg.parallel.pp_stages_per_rank, cfg.parallel.pp_layers,
                                          cfg.training.seq_len))
    micro_batch = blocks_per_unit = None
    if cfg.training.micro_batch_size != "auto":
        micro_batch = cfg.training.micro_batch_size
        batch = plan_batch(cfg.training.global_batch_size, dims.dp_size, micro_batch)
        if dims.pp > 1:
            pipeline_microbatches(cfg, batch.per_rank, batch.accumulation)
    elif cfg.training.global_batch_size % dims.dp_size:
        plan_batch(cfg.training.global_batch_size, dims.dp_size, 1)
    if cfg.parallel.fsdp_blocks_per_unit != -1:
        blocks_per_unit = cfg.parallel.fsdp_blocks_per_unit
    elif micro_batch is not None:
        blocks_per_unit = auto_blocks_per_unit(args, micro_batch, cfg.training.seq_len, dims.tp,
                                               cfg.parallel.reshard_after_forward and dims.pp == 1)
    return micro_batch, blocks_per_unit, stage_layers


def resolve_data(cfg: Config, args: ModelArgs, tokenizer_dir: Path | None,
                 log: Log) -> tuple[str | None, list[str], int | None]:
    """(the token file the workers read, the tokenizer files every checkpoint carries, the id
    between packed documents): the corpus tokenized once here, or SFT conversations prepared."""
    if cfg.data.path == RANDOM_DATA:
        return None, (tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []), None
    if tokenizer_dir is None:
        raise DuokaError(f"model.flavor={cfg.model.flavor} has no tokenizer to read data.path with",
                         "set model.tokenizer to a Qwen2 tokenizer folder (or a hub id such as Qwen/Qwen2-7B)")
    tokenizer = Tokenizer(tokenizer_dir)
    if tokenizer.vocab_size > args.vocab_size:
        raise DuokaError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{args.vocab_size}", "use the model's own tokenizer, or a flavor with a larger vocabulary")
    t = time.perf_counter()
    end_of_text = end_of_text_id(tokenizer)
    if cfg.data.mode == "sft":
        token_file = _sft_tokens(cfg, tokenizer, log)
    else:
        data_path = Path(cfg.data.path) if cfg.data.path else bundled_corpus()
        if is_prepared(data_path):
            manifest = read_manifest(data_path)
            if manifest["tokenizer"] != tokenizer.fingerprint:
                raise DuokaError(f"{data_path} was prepared with the tokenizer in {manifest['tokenizer_dir']}, "
                                 f"not the model's ({tokenizer.folder})",
                                 f"prepare it again: duoka prepare --data SOURCE --out DIR --tokenizer {tokenizer.folder}")
            token_file = str(data_path)
        else:
            token_file = str(tokenize_corpus(data_path, tokenizer, cfg.data.text_field))
        # Raises if the corpus is too small or holds ids beyond the model's vocabulary (read once, here).
        windows = len(PackedWindows(Path(token_file), cfg.training.seq_len, args.vocab_size))
        log(f"duoka: data {data_path}: {windows:,} windows of {cfg.training.seq_len} tokens "
            f"({time.perf_counter() - t:.1f} s)")
    return token_file, tokenizer_files(tokenizer_dir), end_of_text


def _sft_tokens(cfg: Config, tokenizer: Tokenizer, log: Log) -> str:
    if not cfg.data.path:
        raise DuokaError("data.mode=sft needs data.path (JSONL conversations)",
                         'give a .jsonl file with one {"messages": [...]} per line')
    t = time.perf_counter()
    data_path = Path(cfg.data.path)
    token_path, stats = prepare_sft(data_path, tokenizer, cfg.training.seq_len, cfg.data.messages_field,
                                    cfg.data.sft_overlong)
    log(f"duoka: sft data {data_path}: {stats.conversations:,} conversations -> {stats.windows:,} windows, "
        f"{stats.target_tokens:,} target tokens; {stats.truncated} truncated, {stats.dropped} dropped "
        f"(longer than {cfg.training.seq_len + 1} tokens), {stats.no_target} skipped (no assistant token "
        f"within that length) ({time.perf_counter() - t:.1f} s)")
    return str(token_path)


def resolve_resume(spec: RunSpec, run_dir: Path, log: Log) -> RunSpec:
    """The spec in `run_dir` (written into its config as job.output_dir), resuming from the
    checkpoint checkpoint.resume names there, checked against this run (LoRA base, optimizer,
    steps). Called by the launcher holding the run directory."""
    cfg = spec.cfg
    resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume,
                                         trust_unverified=cfg.checkpoint.trust_unverified)
    resume_step = 0
    if resume_from is not None:
        train_state = read_train_state(resume_from)
        adapters.check_resume(resume_from, train_state, adapters.lora_args(cfg), spec.base)
        check_optimizer_resume(resume_from, train_state, cfg)
        resume_step = train_state["step"]
        if resume_step > cfg.training.steps:
            raise DuokaError(f"{resume_from} is at step {resume_step}, past training.steps={cfg.training.steps}",
                             f"raise training.steps above {resume_step} to train further")
        log(f"duoka: resuming from {resume_from} (step {resume_step})")
    config = {**spec.config, "job": {**spec.config["job"], "output_dir": str(run_dir)}}
    return dataclasses.replace(spec, config=config, run_dir=str(run_dir),
                               resume_from=str(resume_from) if resume_from else None, resume_step=resume_step)
