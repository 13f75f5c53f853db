"""Training configuration: typed dataclass sections, read from TOML, overridden from the
command line.

Precedence, lowest to highest: the defaults below < the TOML file < `--section.key=value`
flags (in the order given). Every key is checked: an unknown one is refused with the
nearest valid key, a bad value with the allowed range or choices. The resolved config is
written to the run directory as config.toml, which `duoka train` accepts back as is.
docs/config.md is generated from the field metadata here (`python -m duoka.config`).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from duoka.errors import DuokaError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def opt(default, help: str, *, choices: tuple | None = None, min: float | None = None, max: float | None = None,
        kind: type | None = None, names: bool = False):
    """A config field with its documentation and limits in one place. names: a string of
    comma-separated names, which TOML may also give as an array of strings."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "kind": kind, "names": names}
    return field(default=default, metadata=meta)


@dataclass
class JobConfig:
    output_dir: str = opt("", "Run directory (config.toml, metrics.jsonl, checkpoints/). Empty: runs/<flavor>-<time>; "
                              "in a Slurm job runs/<flavor>-slurm-<job id>, which a requeued job finds again.")


@dataclass
class ModelConfig:
    flavor: str = opt("debug", "Shape to train from scratch (see `duoka.models.qwen2.FLAVORS`): debug, qwen2-0.5b, "
                               "qwen2-1.5b, qwen2-7b, qwen2-72b, qwen2.5-0.5b ... qwen2.5-72b; mixture of experts: "
                               "qwen2-moe-tiny, qwen2-moe-a2.7b, qwen2-57b-a14b. Ignored when path is set.")
    path: str = opt("", "Hugging Face folder or hub id to start from (its config.json and weights). Empty: random init.")
    tokenizer: str = opt("", "Folder with tokenizer.json. Empty: the model path's, or the bundled one for `debug`.")
    check_weights: bool = opt(True, "Refuse model.path's weights if a tensor holds NaN or infinity (one pass over "
                                    "the loaded weights on the device: docs/reliability.md gives its cost).")


@dataclass
class DataConfig:
    path: str = opt("", "Training text: a .txt file (one document per blank-line-separated block), a .jsonl or "
                        ".jsonl.gz file, or a folder of them. Empty: the bundled corpus. `random`: uniform random "
                        "tokens (for throughput measurements only).")
    mode: str = opt("pretrain", "pretrain: documents packed into windows, every token a target. sft: chat "
                                "conversations (JSONL, a list of messages per line) rendered with the model's chat "
                                "template, loss on the assistant turns only, whole conversations packed per window.",
                    choices=("pretrain", "sft"))
    text_field: str = opt("text", "JSONL field that holds the document text (pretrain).")
    messages_field: str = opt("messages", "JSONL field that holds the list of {role, content} messages (sft).")
    sft_overlong: str = opt("truncate", "sft: a conversation longer than training.seq_len + 1 tokens is cut to "
                                        "fit (truncate) or skipped (drop); counts are reported.",
                            choices=("truncate", "drop"))
    document_masking: bool = opt(True, "Packed windows attend only within each document, with positions "
                                       "restarting per document (exact). false: plain causal windows across "
                                       "document boundaries.")
    document_masking_kernel: str = opt("auto", "How document masking runs: varlen (flash attention over the "
                                               "concatenated documents, CUDA only), flex (flex attention block "
                                               "mask), sdpa (dense mask). auto: varlen on CUDA, the fastest on H200 "
                                               "(bench/results/attention_masking.md); sdpa on CPU.",
                                       choices=("auto", "varlen", "flex", "sdpa"))


@dataclass
class TrainingConfig:
    steps: int = opt(200, "Optimizer steps.", min=1)
    seq_len: int = opt(128, "Tokens per sample.", min=8)
    global_batch_size: int = opt(16, "Samples per optimizer step, summed over all data-parallel ranks and "
                                     "gradient-accumulation micro-batches.", min=1)
    micro_batch_size: int | str = opt("auto", "Samples per forward/backward on one rank, or `auto`: the largest "
                                              "divisor of the per-rank batch that fits in memory (the whole per-rank "
                                              "batch on CPU).", min=1, kind=int)
    seed: int = opt(0, "Seed for initialisation and data order.", min=0)
    dtype: str = opt("auto", "`bf16`: bf16 compute with fp32 master weights and fp32 gradient reduction. `fp32`: "
                             "full precision (used by the equivalence tests). `auto`: bf16 on GPU, fp32 on CPU.",
                     choices=("auto", "bf16", "fp32"))
    grad_clip: float = opt(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.", min=0.0)
    activation_checkpointing: str = opt("none", "`full` recomputes each decoder block in the backward pass "
                                                "(less memory, about a third more compute).", choices=("none", "full"))
    compile: bool | str = opt("auto", "torch.compile each decoder block and the loss: faster steps after a first "
                                      "step that compiles (its time is shown; the artefacts are kept in "
                                      "compile_cache, so the next launch of the same layout compiles little). auto: "
                                      "on for CUDA, off on CPU (where compiling costs more than it saves). Before "
                                      "training, one small block is compiled as a check; where that fails on any "
                                      "rank, a warning names the cause and every rank trains uncompiled.",
                              kind=bool)
    compile_cache: str = opt("", "Folder for torch.compile's artefacts (Inductor's FX graph and AOTAutograd caches, "
                                 "Triton kernels under triton/), kept between runs. Empty: "
                                 "$TORCHINDUCTOR_CACHE_DIR when set, else $DUOKA_CACHE/torch-compile, else "
                                 "$XDG_CACHE_HOME/duoka/torch-compile (~/.cache/duoka/torch-compile).")
    float8: str = opt("none", "Train the decoder blocks' linear layers with float8 matmuls (torchao; GPUs of compute "
                              "capability 8.9 or newer; pair it with compile). tensorwise: one scale per tensor, the "
                              "fastest, and FSDP2 gathers the weights in float8; rowwise: one scale per row, closer "
                              "to bf16. Not bit-equal to bf16: compare the loss curve. Not with tp.",
                      choices=("none", "tensorwise", "rowwise"))
    attention_kernel: str = opt("auto", "Causal attention kernel behind SDPA on GPU: flash, cudnn or efficient; "
                                        "auto: cudnn on Hopper and newer (1.3-1.9x flash's speed there, measured), "
                                        "PyTorch's choice elsewhere. Only the chosen kernel is allowed: a shape it "
                                        "cannot run is an error, not a silent fallback. See "
                                        "bench/results/attention_kernels.md.",
                                choices=("auto", "flash", "cudnn", "efficient"))
    fuse_qkv: bool = opt(True, "Compute the query, key and value projections as one matmul over their "
                               "concatenated weights (the parameters stay separate). Exact; not under tp or "
                               "float8, which keep one matmul per projection. See docs/performance.md.")
    fused_loss: bool = opt(False, "Compute the output head and the cross-entropy together, chunk by chunk, never "
                                  "holding the logits of more than 4096 tokens (saves ~1.5 MB per token with Qwen2's "
                                  "152k vocabulary). Not under tp (its loss is vocabulary-parallel) or pp.")


@dataclass
class OptimizerConfig:
    name: str = opt("adamw", "The optimizer (docs/training.md, Optimizers). adamw: PyTorch's AdamW (fused on CUDA), "
                             "8 bytes of state per trained parameter. adamw8bit, adamw4bit: AdamW with block-wise "
                             "quantized moments (torchao; 2 and 1 bytes per parameter, Dettmers et al. "
                             "arXiv:2110.02861, Li et al. arXiv:2309.01507). adafactor: factored second moment, no "
                             "first moment (PyTorch's Adafactor; its lr caps a step relative to each parameter's "
                             "RMS). muon: Muon (PyTorch's; momentum orthogonalised by Newton-Schulz, Jordan et al. "
                             "2024) on the decoder blocks' 2-D matrices, 4 bytes per parameter, with AdamW for "
                             "embeddings, head, norms and biases. sgd: SGD with momentum, 4 bytes per parameter.",
                     choices=("adamw", "adamw8bit", "adamw4bit", "adafactor", "muon", "sgd"))
    offload: str = opt("none", "cpu: AdamW's state and step in host memory (torchao's CPUOffloadOptimizer), each "
                               "gradient copied to the host as backward produces it; frees the 8 bytes per "
                               "parameter of AdamW state (and its step) from the GPU for host memory (16 bytes per "
                               "parameter: master copy, gradient, two moments) and PCIe traffic. One GPU and "
                               "optimizer.name=adamw only.", choices=("none", "cpu"))
    # At most 1e6: a run at a larger lr moves every weight by millions a step and trains nothing (a
    # test forces a blow-up at 1e6), and near float32's 3.4e38 torch's optimizers fail on it.
    lr: float = opt(3e-3, "Peak learning rate at reference_batch_size (before lr_scaling).", min=0.0, max=1e6)
    lr_scaling: str = opt("none", "Scale lr with the global batch: linear (lr * B/B_ref, Goyal et al. 2017) or sqrt "
                                  "(lr * sqrt(B/B_ref), for Adam-type optimisers, Malladi et al. 2022).",
                          choices=("none", "linear", "sqrt"))
    reference_batch_size: int = opt(0, "B_ref for lr_scaling; 0 means the global batch size (no scaling).", min=0)
    schedule: str = opt("cosine", "After warmup: cosine or linear decay to min_lr_ratio * lr, constant, or wsd "
                                  "(warmup-stable-decay: constant, then linear decay over the last decay_fraction "
                                  "of the steps).", choices=("cosine", "linear", "constant", "wsd"))
    warmup_steps: int = opt(10, "Linear warmup steps from 0 to the peak lr.", min=0)
    min_lr_ratio: float = opt(0.1, "Final lr as a fraction of the peak.", min=0.0, max=1.0)
    decay_fraction: float = opt(0.2, "wsd only: fraction of the steps spent decaying.", min=0.0, max=1.0)
    weight_decay: float = opt(0.1, "Weight decay, applied to parameters with 2 or more dimensions only (not to norms "
                                   "and biases): decoupled (AdamW, its 8- and 4-bit forms, adafactor, muon), or an L2 "
                                   "term added to the gradient (sgd).", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1 (also adamw8bit, adamw4bit and muon's AdamW part).", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2 (also adamw8bit, adamw4bit and muon's AdamW part).", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon (also adamw8bit, adamw4bit and muon's AdamW part).", min=0.0)
    sgd_momentum: float = opt(0.9, "sgd: momentum factor (0: plain SGD).", min=0.0, max=1.0)
    muon_momentum: float = opt(0.95, "muon: momentum factor of the matrices' update (Muon's authors use 0.95).",
                               min=0.0, max=1.0)
    nesterov: bool = opt(True, "sgd and muon: Nesterov momentum (Muon's default; for sgd it needs sgd_momentum > 0).")
    muon_ns_steps: int = opt(5, "muon: Newton-Schulz iterations that orthogonalise each matrix's update (5, as "
                                "Muon's authors tuned its coefficients for).", min=1, max=99)
    muon_adamw_lr: float = opt(0.0, "muon: peak lr of the AdamW part (embeddings, head, norms, biases), following the "
                                    "same schedule; 0: the same as lr. Muon's update is scaled to AdamW's RMS "
                                    "(Liu et al., arXiv:2502.16982), so one lr usually suits both.", min=0.0)


@dataclass
class LoRAConfig:
    rank: int = opt(0, "LoRA (low-rank adapters, arXiv:2106.09685) on when > 0: the base weights are frozen and kept "
                       "in the compute dtype (no fp32 copy, no optimizer state); only the adapters (and "
                       "modules_to_save) train. The final hf/step-N is a PEFT adapter folder. See docs/lora.md.",
                     min=0)
    alpha: float = opt(0.0, "Scale of the adapter's product: alpha / rank. 0: twice the rank (LLaMA-Factory's "
                            "default).", min=0.0)
    dropout: float = opt(0.0, "Dropout on each adapter's input (as PEFT's lora_dropout).", min=0.0, max=0.99)
    target_modules: str = opt("all-linear", "Linear layers that get adapters, by their Hugging Face names, "
                                            "comma-separated (or a TOML array): q_proj, k_proj, v_proj, o_proj, "
                                            "gate_proj, up_proj, down_proj; all-linear: all seven (not the "
                                            "output head).", names=True)
    modules_to_save: str = opt("", "Modules trained whole beside the adapters, comma-separated: embed_tokens, "
                                   "lm_head (one matrix when the model ties them). Empty: none.", names=True)
    quantize: str = opt("none", "QLoRA (arXiv:2305.14314): nf4 holds the frozen linear weights of the decoder blocks "
                                "in 4-bit NormalFloat (torchao), about 0.52 bytes per weight instead of 2; one "
                                "process, DDP or FSDP2. none: the compute dtype.", choices=("none", "nf4"))


@dataclass
class ParallelConfig:
    dp_mode: str = opt("ddp", "Data parallelism: ddp (replicated weights, all-reduced gradients) or fsdp (FSDP2: "
                              "parameters, gradients and optimizer state sharded over dp_shard ranks, replicated over "
                              "dp_replicate groups; both > 1 is HSDP).", choices=("ddp", "fsdp"))
    dp_replicate: int = opt(-1, "Replica groups. -1: all ranks for ddp, 1 for fsdp.", min=-1)
    dp_shard: int = opt(-1, "Ranks one fsdp replica is sharded over. -1: world size / dp_replicate.", min=-1)
    reshard_after_forward: bool = opt(True, "fsdp: free gathered parameters after forward and gather again in "
                                            "backward (less memory, more communication).")
    reduce_every_microbatch: bool = opt(False, "fsdp with gradient accumulation: reduce-scatter every micro-batch's "
                                               "gradients (sharded fp32 accumulation) instead of only the last one's. "
                                               "Saves the unsharded fp32 gradients between micro-batches (4 bytes "
                                               "per parameter per GPU) for more reduce-scatter traffic, overlapped "
                                               "with backward.")
    fsdp_blocks_per_unit: int = opt(-1, "fsdp: consecutive transformer blocks sharded as one FSDP2 unit (one "
                                          "all-gather and one reduce-scatter each); 0: all blocks in one unit; -1 "
                                          "(auto): without resharding, enough blocks that a unit's forward outlasts "
                                          "FSDP2's host work per unit (small models: Qwen2-0.5B at micro-batch 8 "
                                          "gets 3), else 1. More blocks per unit mean fewer, larger collectives and "
                                          "less host work, but with resharding more gathered weights alive at once.",
                                    min=-1)
    ddp_bucket_mb: int = opt(1000, "ddp: gradient bucket size in MB (PyTorch's default is 25). Larger buckets "
                                   "launch fewer, larger all-reduces, later in backward: Qwen2-0.5B ran 2.5-4.8% "
                                   "faster with 200-4000 than with 25 (docs/performance.md).",
                             min=1)
    tp: int = opt(1, "Tensor-parallel degree, with sequence parallelism (Megatron-style column/row sharding of "
                     "attention and MLP, norms and dropout-free regions sharded on the sequence). Must divide the "
                     "model's attention heads and KV heads; best kept within one NVLink domain.", min=1)
    pp: int = opt(1, "Pipeline-parallel degree: the layers split into pp stages (torch.distributed.pipelining).",
                  min=1)
    ep: int = opt(1, "Expert-parallel degree (mixture-of-experts models): each group of ep neighbouring dp_shard "
                     "ranks splits every MoE layer's routed experts, num_experts / ep per rank, and exchanges the "
                     "tokens by all-to-all; the expert weights are FSDP2-sharded over the dp_shard / ep ranks "
                     "holding the same experts, everything else as without ep. Needs dp_mode=fsdp; must divide "
                     "dp_shard and the model's num_experts.", min=1)
    cp: int = opt(1, "Context-parallel degree: each sequence split over cp neighbouring dp_shard ranks, which share "
                     "their data; with 2 x cp chunks, rank i holds chunk i and chunk 2cp-1-i (causal attention's "
                     "work balanced), and attention spans the whole sequence by cp_method. FSDP2 shards over all "
                     "of dp_shard. Needs dp_mode=fsdp; must divide dp_shard; training.seq_len a multiple of 2 x cp; "
                     "not with tp, pp, ep or load balancing yet.", min=1)
    cp_method: str = opt("auto", "How attention spans a sequence split over cp ranks (docs/training.md, Long "
                                 "context): allgather (every rank's keys and values all-gathered, a dense mask of "
                                 "the rank's queries by every key); ulysses (DeepSpeed-Ulysses: an all-to-all gives "
                                 "each rank the whole sequence for 1/cp of the heads, attention runs as in one "
                                 "process, causal or with the document masking kernel, and an all-to-all brings "
                                 "the rank's tokens back; the attention heads must divide by cp, KV heads fewer "
                                 "than cp are repeated); auto: ulysses where the heads divide by cp, else allgather.",
                         choices=("auto", "allgather", "ulysses"))
    pp_schedule: str = opt("1f1b", "Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (needs "
                                   "pp_stages_per_rank >= 2), zero_bubble (interleaved zero-bubble, needs "
                                   "pp_stages_per_rank >= 2).",
                           choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"))
    pp_stages_per_rank: int = opt(1, "Virtual pipeline stages per rank (interleaved schedules).", min=1)
    pp_layers: str = opt("even", "How layers split over the pp x pp_stages_per_rank stages: even (the first and last "
                                 "stage count the embedding and the output head as one layer each), flops (balanced "
                                 "by each piece's training FLOPs), measured (balanced by the forward + backward time "
                                 "of a block and of the head, timed on the GPUs at start), or an explicit "
                                 "comma-separated list of layer counts per stage, e.g. \"6,8,8,6\".")
    pp_microbatches: int = opt(0, "Micro-batches per pipeline step; 0: the per-rank batch / micro_batch_size.", min=0)
    balance: str = opt("off", "Shares of each global batch per data-parallel rank: off (equal), static (in "
                              "proportion to balance_weights), auto (follow each GPU's measured speed, re-balanced "
                              "while training; starts from balance_weights when given). The gradient is the "
                              "equal split's either way. See docs/training.md#load-balancing.",
                       choices=("off", "static", "auto"))
    balance_weights: str = opt("", "Relative speed per data-parallel rank, comma-separated (e.g. \"1,1,0.5,1\"), "
                                   "for balance=static or as auto's start; `duoka doctor --bench` measures them.")
    balance_window: int = opt(8, "auto: steps of measurements (their median per rank) behind each decision.", min=2)
    balance_hysteresis: float = opt(0.05, "auto: change the shares only if the predicted step time falls by at least "
                                          "this fraction.", min=0.0, max=0.9)


@dataclass
class CheckpointConfig:
    enabled: bool = opt(True, "Write resumable checkpoints (model, optimizer, step) to checkpoints/step-N/ with "
                              "torch.distributed.checkpoint: every `interval` steps, at the end, and on SIGTERM.")
    interval: int = opt(0, "Steps between checkpoints; 0: only at the end (and on SIGTERM).", min=0)
    async_save: bool = opt(False, "Copy the state to host memory (pinned buffers reused by every save on GPU) and "
                                  "write the files in a background thread: training is blocked only for the copy.")
    write_threads: int = opt(1, "Files written in parallel per rank (torch.distributed.checkpoint's thread_count); "
                                "more can help on parallel file systems (no clear gain on one local NVMe disk, "
                                "bench/results/checkpoint_times.md).", min=1)
    keep: int = opt(2, "Complete checkpoints to keep; older ones are deleted once a newer one is complete.", min=1)
    resume: str = opt("", "`auto`: continue from the newest intact checkpoint in job.output_dir (each is checked "
                          "against its manifest; damaged ones are skipped with a warning; start fresh if there is "
                          "none); a checkpoints/step-N path: continue from it; empty: start fresh.")
    export_final: bool = opt(True, "Also write the final model in Hugging Face format to hf/step-<steps>/.")
    trust_unverified: bool = opt(False, "Resume from a checkpoint without manifest.json (saved by a duoka older than "
                                        "manifests, or copied without it): its files' sizes and checksums cannot be "
                                        "checked, so damaged or altered bytes go unnoticed. Off: such a checkpoint is "
                                        "refused (auto skips it). Its pickled parts are read by the restricted "
                                        "unpicklers either way.")


@dataclass
class MetricsConfig:
    log_interval: int = opt(10, "Print a progress line every this many steps (metrics.jsonl gets every step).", min=1)
    peak_tflops: float = opt(0.0, "Per-device dense bf16 peak for MFU, in TFLOP/s; 0: from the GPU's name "
                                  "(989 for H100/H200 SXM). CPU runs report no MFU.", min=0.0)
    tensorboard: bool = opt(True, "Write TensorBoard event files to <run>/tensorboard/ (rank 0).")
    prometheus_port: int = opt(0, "Serve Prometheus metrics (duoka_*) on this port, one endpoint per node on its "
                                  "first rank covering the node's ranks; 0: off.", min=0, max=65535)
    prometheus_host: str = opt("127.0.0.1", "Address the Prometheus endpoint binds to (0.0.0.0 for every "
                                            "interface: only on a trusted network).")
    gpu_interval_s: float = opt(2.0, "Seconds between NVML readings of each rank's GPU (a background thread; "
                                     "the step never waits for it).", min=0.1)
    alerts: bool = opt(True, "Log an alert with its fix when a rank falls behind, a GPU throttles or nears full "
                             "memory, the data wait exceeds 5% of the step, or MFU is far below this model's.")
    profile_step: int = opt(0, "Record this step with torch.profiler: profile/trace-rank<R>.json (open in "
                               "Perfetto or chrome://tracing) and profile/kernels-rank<R>.json (device time per "
                               "kernel). 0: off.", min=0)
    profile_steps: int = opt(1, "Consecutive steps recorded from profile_step; more than one shows how one step's "
                                "work follows the last (whether the host keeps ahead of the GPU).", min=1)


@dataclass
class ReliabilityConfig:
    hang_timeout_s: float = opt(0.0, "A step or collective that has not finished after this many seconds ends the job "
                                     "with a message naming the step, the collective and the ranks that did not "
                                     "arrive, and every rank's Python stack in <run>/hang/. 0: 600 on GPU, 300 on CPU "
                                     "(the first steps also compile: timed from the third step on).", min=0.0)
    straggler_factor: float = opt(5.0, "Alert (straggler) when a rank's step has taken this many times the median "
                                       "step so far without finishing.", min=1.0)
    max_nonfinite_steps: int = opt(3, "A step whose loss or gradient norm is NaN or infinite is skipped (no update, "
                                      "counted, alerted); after this many in a row the job stops, naming the last "
                                      "good checkpoint.", min=1)
    spike_zscore: float = opt(6.0, "Alert (loss_spike) when a step's loss lies this many standard deviations above "
                                   "the mean of the last spike_window steps; 0: off.", min=0.0)
    spike_window: int = opt(50, "Steps in the loss-spike statistics.", min=5)
    skip_spikes: bool = opt(False, "Also skip the update of a step whose loss is a spike (as for a non-finite one).")


@dataclass
class DebugConfig:
    slow_ranks: str = opt("", "Fault injection for tests and demos: \"RANK:FACTOR,...\" makes each named rank run "
                              "at FACTOR of its speed (1:0.5 = rank 1 at half speed): it waits in proportion to its "
                              "own measured compute (each block and the LM head, the loss and the optimizer).")
    check_host_syncs: bool = opt(False, "GPU only: from the third step on, raise at any operation inside a step that "
                                        "makes the host wait for the GPU (torch.cuda.set_sync_debug_mode), naming "
                                        "where it is; steps are meant to have none, so the host runs ahead.")
    inject_nan_step: int = opt(0, "Fault injection for tests: step N's loss (1-based) is NaN on every rank. 0: off.",
                               min=0)
    inject_nan_count: int = opt(1, "Fault injection for tests: with inject_nan_step=N, steps N to N + this - 1 are "
                                   "NaN (a run that stays diverged, on every machine alike).", min=1)
    fail_compile_ranks: str = opt("", "Fault injection for tests: the compile check (training.compile) fails on these "
                                      "ranks, comma-separated, or `all`: every rank must then warn once and train "
                                      "uncompiled.")


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> "Config":
        cfg = cls()
        for section, values in data.items():
            for key, value in values.items():
                _set(cfg, section, key, value, origin="config")
        return cfg


SECTIONS = [f.name for f in fields(Config)]


def _section_fields(cfg: Config, section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in fields(getattr(cfg, section))}


def _all_keys(cfg: Config) -> list[str]:
    return [f"{s}.{k}" for s in SECTIONS for k in _section_fields(cfg, s)]


def suggest_key(name: str) -> str | None:
    """The config key `name` most likely means: a right key in the wrong section or with no
    section (training.lr, lr, output-dir -> optimizer.lr, optimizer.lr, job.output_dir), else
    the closest spelling; None when nothing is close."""
    keys = _all_keys(Config())
    name = name.replace("-", "_")
    tail = name.split(".")[-1]
    same = [k for k in keys if k.split(".")[-1] == tail]
    if same:
        return same[0]
    if "." in name:
        close = difflib.get_close_matches(name, keys, n=1, cutoff=0.5)
        return close[0] if close else None
    by_tail = {k.split(".")[-1]: k for k in reversed(keys)}  # the first section's key where two share a name
    close = difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.6)
    return by_tail[close[0]] if close else None


def _unknown(name: str, cfg: Config, origin: str) -> DuokaError:
    close = suggest_key(name)
    hint = f"did you mean {close}?" if close else "docs/config.md lists every key"
    return DuokaError(f"{origin}: unknown config key {name!r}", hint)


_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
               dict: "a table"}


def _check_typed(name: str, f: dataclasses.Field, value: Any, origin: str) -> None:
    """A TOML value carries its type, which must be the key's: `steps = "5"` is refused rather
    than converted, as TOML can say 5. Command-line flags are text and convert."""
    kind = f.metadata.get("kind") or type(f.default)
    if kind in (int, bool) and f.default == "auto" and value == "auto":
        return
    accepted = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[kind]
    if isinstance(value, accepted) and not (isinstance(value, bool) and kind is not bool):
        return
    got = next((t for k, t in _TOML_TYPES.items() if isinstance(value, k)), type(value).__name__)
    want = ("a number" if kind is float else _TOML_TYPES[kind]) + (' or "auto"' if f.default == "auto" else "")
    section, key = name.split(".")
    try:
        meant = _coerce(name, f, value, origin) if not isinstance(value, bool) and kind is not str else None
    except DuokaError:
        meant = None
    example = toml_value(meant) if meant is not None else {bool: "true", int: "5", float: "0.5", str: '"text"'}[kind]
    raise DuokaError(f"{origin}: {name} = {toml_value(value)} is {got}, not {want}",
                     f"write {key} = {example} under [{section}]" +
                     (" (without quotes: they make a string)" if isinstance(value, str) else ""))


def _coerce(name: str, f: dataclasses.Field, value: Any, origin: str) -> Any:
    meta = f.metadata
    kind = meta.get("kind") or type(f.default)
    where = f"{origin}: {name}={value!r}"
    if f.default == "auto" and kind in (int, bool) and value == "auto":  # int or "auto", bool or "auto"
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise DuokaError(f"{where} is not a boolean", "use true, false or auto" if f.default == "auto"
                         else "use true or false")
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise DuokaError(f"{where} is not an integer", "write a whole number" +
                             (" or auto" if f.default == "auto" else ""))
        try:
            value = int(value)
        except (TypeError, ValueError):
            raise DuokaError(f"{where} is not an integer", "write a whole number" +
                             (" or auto" if f.default == "auto" else "")) from None
    elif kind is float:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise DuokaError(f"{where} is not a number", "write a number such as 3e-4") from None
        if not math.isfinite(value):
            raise DuokaError(f"{where} is not a finite number", "write a number such as 3e-4")
    elif kind is str:
        if not isinstance(value, str):
            raise DuokaError(f"{where} is not a string", "quote the value in TOML")
    if meta.get("choices") and value not in meta["choices"]:
        raise DuokaError(f"{where} is not allowed", f"choose one of: {', '.join(meta['choices'])}")
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise DuokaError(f"{origin}: {name}={value!r} is out of range", f"{name} must be {rng}")
    return value


def _set(cfg: Config, section: str, key: str, value: Any, origin: str, typed: bool = False) -> None:
    """typed: the value comes from TOML and must already have the key's type."""
    name = f"{section}.{key}"
    if section not in SECTIONS:
        raise _unknown(name, cfg, origin)
    known = _section_fields(cfg, section)
    if key not in known:
        raise _unknown(name, cfg, origin)
    if typed and known[key].metadata.get("names") and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # ["q_proj", "v_proj"] as PEFT users write it
    if typed:
        _check_typed(name, known[key], value, origin)
    setattr(getattr(cfg, section), key, _coerce(name, known[key], value, origin))


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise DuokaError(f"config file {path} does not exist", "pass the path of a TOML file (see configs/)")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise DuokaError(f"{path} is not valid TOML ({e})", "fix the syntax at the position given") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise _unknown(section, cfg, str(path))
            for key, value in values.items():
                _set(cfg, section, key, value, origin=str(path), typed=True)
    apply_overrides(cfg, overrides)
    return cfg


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


def apply_overrides(cfg: Config, overrides: list[str]) -> None:
    """`--section.key=value` or `--section.key value`, as the CLI received them."""
    items = list(overrides)
    i = 0
    while i < len(items):
        arg = items[i]
        if not arg.startswith("--") or "." not in arg:
            raise DuokaError(f"unexpected argument {arg!r}", "config overrides look like --training.steps=100")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(items) or items[i + 1].startswith("--"):
                raise DuokaError(f"--{name} has no value", f"write --{name}=VALUE")
            value = items[i + 1]
            i += 1
        section, _, key = name.partition(".")
        _set(cfg, section.replace("-", "_"), key.replace("-", "_"), value, origin="command line")
        i += 1


# TOML basic strings may not hold a backslash, a quote or a control character as they are
# (tab aside; it is escaped too, for readability): each becomes its escape sequence.
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_char(c: str) -> str:
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    return f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c


def toml_value(v: Any) -> str:
    """A value as TOML writes it, which tomllib reads back equal: the config's own (bool, int,
    float, str) and, for messages about a TOML file's values, arrays, tables and dates."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(_toml_char(c) for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return v.isoformat()
    raise TypeError(f"TOML has no value of type {type(v).__name__}: {v!r}")


def to_toml(cfg: Config) -> str:
    """TOML for our own value types (str, int, float, bool): enough for config.toml."""

    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def reference_markdown() -> str:
    """docs/config.md, generated from the fields above."""
    cfg = Config()
    out = ["# Configuration reference", "",
           "Generated from `duoka/config.py` by `python -m duoka.config > docs/config.md`.", "",
           "Precedence, lowest to highest: defaults < the TOML file < `--section.key=value` flags on the "
           "command line (in their order). Unknown keys and out-of-range values are refused before any "
           "worker starts. The resolved config is saved as `config.toml` in the run directory.", ""]
    for section in SECTIONS:
        out += [f"## [{section}]", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in fields(getattr(cfg, section)):
            m = f.metadata
            allowed = ", ".join(map(str, m["choices"])) if m.get("choices") else ""
            if m.get("kind") is bool and f.default == "auto":
                allowed = "auto, true, false"
            if m.get("min") is not None:
                allowed = f">= {m['min']}" if m.get("max") is None else f"{m['min']} to {m['max']}"
                if f.default == "auto":
                    allowed = f"auto or {allowed}"
            out.append(f"| `{f.name}` | `{f.default!r}` | {allowed} | {m['help']} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
