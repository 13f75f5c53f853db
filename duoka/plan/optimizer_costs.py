"""What each optimizer keeps and does in a training step, for the planner: its state bytes
per parameter on the GPU (and, offloaded, on the host), what its step allocates beyond the
state, and what the step costs. The names are the config's optimizer.name and
optimizer.offload.

Counted from the implementations the trainer runs (torch 2.13, torchao 0.18), per tensor,
since the rules depend on each tensor's shape and size. The state has the dtype of the
gradients it follows: fp32 here, as the master weights and gradients stay fp32.
- adamw: torch.optim.AdamW(fused=True): exp_avg and exp_avg_sq, 8 bytes.
- adamw8bit / adamw4bit: torchao.optim.AdamW8bit / AdamW4bit: both moments as 8-bit codes
  (4-bit: two codes a byte) with one fp32 scale per block of 256 (4-bit: 128) elements and an
  fp32 lookup table per state tensor (torchao/optim/subclass_8bit.py, subclass_4bit.py:
  OptimState8bit.zeros, OptimState4bit.zeros); tensors below 4096 elements, or not a whole
  number of blocks, keep fp32 moments (torchao/optim/adam.py: _AdamBase._new_buffer).
- adafactor: torch.optim.Adafactor: no first moment (torch's has no beta1), the second moment
  of a matrix factored into a row and a column vector, of a vector kept whole
  (torch/optim/_adafactor.py: Adafactor._init_group). Built with foreach=True, its step
  allocates a full fp32 variance estimate of every matrix at once (4 bytes per parameter).
- muon: torch.optim.Muon on the decoder blocks' 2-D matrices (one fp32 momentum buffer,
  torch/optim/_muon.py: Muon._init_group), AdamW on the embedding, the head, the norms and the
  biases, as Muon's authors prescribe (Jordan et al. 2024, kellerjordan.github.io/posts/muon).
  A sharded matrix's update is gathered whole and orthogonalised on every rank
  (duoka/train/optimizers.py: WholeMatrixMuon).
- sgd: torch.optim.SGD: one fp32 momentum buffer when momentum > 0, none without.
- offload=cpu: torchao.optim.CPUOffloadOptimizer around AdamW (torchao/optim/cpu_offload.py):
  every tensor of at least 4096 elements gets a pinned host copy of its weight and gradient
  and an AdamW on the host (fused CPU kernel); the GPU keeps its fp32 weights and gradients
  (offload_gradients=False, the default, which gradient accumulation needs) and the AdamW
  state of the small tensors. It is for one GPU (its docstring: "for single-GPU training").

Under FSDP2 the state follows the parameter's shard (dim 0), as the parameters do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from duoka.config import OptimizerConfig
from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs

_CONFIG_FIELDS = {f.name: f for f in fields(OptimizerConfig)}
OPTIMIZERS = _CONFIG_FIELDS["name"].metadata["choices"]
OFFLOADS = _CONFIG_FIELDS["offload"].metadata["choices"]
CONFIG_DEFAULTS = OptimizerConfig()  # the [optimizer] section's defaults: what a plan leaves unset

# ---- state (torch 2.13, torchao 0.18; see the module docstring for the files)
FP32 = 4
ADAMW_STATE_BYTES = 2 * FP32  # exp_avg + exp_avg_sq
# torchao quantizes a state tensor only from this many elements ("follow bitsandbytes, only
# quantize tensors >= 4096 values", adam.py: _AdamBase._new_buffer), and only when its local
# size is a whole number of blocks; otherwise the moment is a plain fp32 tensor.
TORCHAO_MIN_NUMEL = 4096


@dataclass(frozen=True)
class Quantized:
    code_bytes: float  # per element and moment: uint8 codes (8-bit), two per byte (4-bit)
    block: int  # elements per fp32 scale (the optimizer's block_size default)
    qmap_entries: int  # the fp32 lookup table each state tensor carries


QUANTIZED = {
    # adam.py: AdamW8bit(block_size=256); subclass_8bit.py: create_dynamic_map() has 2**8 entries
    "adamw8bit": Quantized(1.0, 256, 256),
    # adam.py: AdamW4bit(block_size=128); subclass_4bit.py: codes numel // 2, 16-entry maps
    "adamw4bit": Quantized(0.5, 128, 16),
}
# What torchao's step allocates beyond the state, in bytes per element of the tensor being
# updated (one tensor at a time: adam.py compiles single_param_adam per parameter). The
# buffers inductor allocates in the code it generates for that function (TORCH_LOGS=
# output_code, torch 2.13, on CPU): 8-bit, the fp32 exp_avg and exp_avg_sq it lerps before
# re-quantizing (2 x 4); 4-bit, those and two int64 code indices of its 4-bit packing
# (2 x 4 + 2 x 8) and two half-size uint8 code buffers (2 x 0.5). The GPU's Triton code may
# keep some of them in registers: the GPU measurement of issue 27 checks these. (The trainer
# compiles this step with training.compile, the default on GPUs; eager, it holds more.)
TORCHAO_STEP_TRANSIENT = {"adamw8bit": 8.0, "adamw4bit": 25.0}
# CPUOffloadOptimizer(minimal_size=4096): smaller tensors keep an AdamW on the GPU.
OFFLOAD_MIN_NUMEL = 4096
# Host bytes per offloaded element: a pinned fp32 weight and a pinned fp32 gradient
# (torch.empty_like(..., pin_memory=True) in CPUOffloadOptimizer.__init__) and the host
# AdamW's two fp32 moments (pageable).
OFFLOAD_PINNED_BYTES = 2 * FP32
OFFLOAD_HOST_BYTES = OFFLOAD_PINNED_BYTES + ADAMW_STATE_BYTES
# Built with foreach=True (duoka/train/optimizers.py: build_optimizer): Adafactor, and Muon's
# AdamW for the rest. Their step allocates a list of temporaries as large as a parameter
# group (torch/optim/_adafactor.py: _multi_tensor_adafactor's var_estimates, "~ sizeof(params)
# more peak memory" in its docstring; torch/optim/adam.py: _multi_tensor_adam's
# exp_avg_sq_sqrt). AdamW alone is fused on CUDA: in place. SGD is foreach too (its fused
# step leaves a skipped first step's momentum uninitialised), and with weight decay its step
# makes a decayed copy of a group's gradients (torch/optim/sgd.py: _multi_tensor_sgd's
# `device_grads = torch._foreach_add(device_grads, device_params, ...)`; Nesterov then adds in
# place): fp32 as large as the decayed group (the 2-D tensors), ~53 GiB for Qwen1.5-MoE-A2.7B.
FOREACH = ("adafactor", "muon")

# ---- traffic of the step through the GPU's memory, bytes per element (+ 4: the gradient
# clipping's norm reads every gradient once)
STEP_HBM_BYTES = {
    # fused: read w, g, m, v (16), write w, m, v (12)
    "adamw": 32,
    # read w, g and two 1-byte codes (10), write w and codes (6), the transient written and
    # read back (2 x 8)
    "adamw8bit": 36,
    # read w, g and two half-byte codes (9), write w and codes (5), the transient (2 x 25)
    "adamw4bit": 68,
    # weight decay (8), the norms of w and g by rows and columns (12), the variance estimate
    # written, divided, clamped and rsqrt'd (4 + 3 x 8), times g (12), its norm (4), added
    # to w (12)
    "adafactor": 80,
    # matrices: momentum lerp (12), Nesterov lerp (12), the bf16 copy (6) and its
    # normalisation (6), weight decay (8), the update added (10); the matmuls count as FLOPs
    "muon": 58,
    # fused, with momentum: read g, buffer and w (12), write buffer and w (8)
    "sgd": 24,
}
SGD_PLAIN_HBM_BYTES = 16  # without momentum: read g and w, write w
# ---- host time of the step's per-tensor calls, measured on a 2-core Xeon (torch 2.13, CPU
# tensors too small to cost compute: 100 of 64 x 64, Muon's 8 x 8; median of 5 steps): an
# upper bound for the faster host of a GPU server. torchao's step calls its compiled function
# once per tensor (dynamo's guards and the call: 438 us); Adafactor (foreach) reads two norms
# per tensor back with .item() (58 us a tensor), so the GPU waits for the host between
# tensors; Muon steps matrix by matrix, ~22 eager ops each (64 us; WholeMatrixMuon's gather
# and slice of a sharded matrix cost more).
TORCHAO_CALL_S = 438e-6
ADAFACTOR_TENSOR_S = 58e-6
MUON_TENSOR_S = 64e-6
# ---- offload: the host's AdamW and the PCIe copies
# torch's fused CPU AdamW streams read w, g, m, v and write w, m, v: 28 bytes an element.
HOST_ADAMW_BYTES = 28
# It ran at 23 GB/s on one core of the planning machine (torch 2.13, 64M elements), 42 GB/s on
# two; an H200 server has 16 cores per GPU (bench/results/doctor/h200x2.json), which would
# reach 370 GB/s if memory kept up. It does not: a two-socket HGX host has 16 channels of
# DDR5-4800 (614 GB/s peak, ~80% reachable), 60 GB/s for each of its 8 GPUs.
HOST_ADAMW_BYTES_PER_S = 60e9
# Pinned host <-> device copies on an H200 server, each way (bench/results/doctor: 54.6-55.3).
PCIE_BYTES_PER_S = 54.6e9


@dataclass(frozen=True)
class OptimizerChoice:
    """An optimizer as the config names it: optimizer.name, optimizer.offload, and what
    changes its state (optimizer.sgd_momentum: no buffer at 0) or its cost
    (optimizer.muon_ns_steps)."""

    name: str = CONFIG_DEFAULTS.name
    offload: str = CONFIG_DEFAULTS.offload
    sgd_momentum: float = CONFIG_DEFAULTS.sgd_momentum
    ns_steps: int = CONFIG_DEFAULTS.muon_ns_steps
    weight_decay: float = CONFIG_DEFAULTS.weight_decay
    """Only SGD's memory depends on it (a decayed copy of the gradients in its step)."""

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise DuokaError(f"optimizer {self.name!r} is unknown", f"choose one of {', '.join(OPTIMIZERS)}")
        if self.offload not in OFFLOADS:
            raise DuokaError(f"offload {self.offload!r} is unknown", "use none or cpu")
        if self.offload == "cpu" and self.name != "adamw":
            raise DuokaError(f"offload=cpu moves AdamW's state and step to the host (torchao's CPUOffloadOptimizer) "
                             f"and does not apply to {self.name}",
                             f"use optimizer {self.name} without offload, or adamw with offload=cpu")

    @property
    def offloaded(self) -> bool:
        return self.offload == "cpu"

    def describe(self) -> str:
        return "adamw + cpu offload" if self.offloaded else self.name

    def state_label(self) -> str:
        """What its GPU state is, in a few words."""
        if self.offloaded:
            return "AdamW moments of tensors < 4096 elements (the rest on the host)"
        return {"adamw": "AdamW moments (fp32)", "adamw8bit": "AdamW moments (8-bit, fp32 block scales)",
                "adamw4bit": "AdamW moments (4-bit, fp32 block scales)",
                "adafactor": "Adafactor second moment (factored, fp32)",
                "muon": "Muon momentum (matrices) + AdamW moments (rest)",
                "sgd": "SGD momentum (fp32)"}[self.name]

    def config(self) -> dict:
        """The [optimizer] keys that select it (those that differ from the defaults)."""
        keys = {"name": self.name}
        if self.offloaded:
            keys["offload"] = self.offload
        if self.name == "sgd" and self.sgd_momentum != CONFIG_DEFAULTS.sgd_momentum:
            keys["sgd_momentum"] = self.sgd_momentum
        if self.name == "muon" and self.ns_steps != CONFIG_DEFAULTS.muon_ns_steps:
            keys["muon_ns_steps"] = self.ns_steps
        return keys


ADAMW = OptimizerChoice()


def optimizer_from_config(optimizer_cfg: OptimizerConfig) -> OptimizerChoice:
    """The OptimizerChoice of a config's [optimizer] section."""
    return OptimizerChoice(optimizer_cfg.name, optimizer_cfg.offload, optimizer_cfg.sgd_momentum,
                           optimizer_cfg.muon_ns_steps, optimizer_cfg.weight_decay)


# ---------------------------------------------------------------- the tensors


@dataclass(frozen=True)
class ParamTensor:
    """`count` parameter tensors of one shape on a rank: rows x cols after tensor parallelism
    (before data-parallel sharding), of a whole full_rows x full_cols. role: `matrix` (a
    decoder block's 2-D weight), `embedding`, `head`, `vector` (a norm's gain, a bias), or
    `experts` (a MoE layer's stacked routed experts [E, out, in], as E·out rows of `in`: 3-D,
    so Muon leaves them to its AdamW, as duoka/train/optimizers.py does)."""

    role: str
    rows: float
    cols: float
    count: int
    full_rows: float
    full_cols: float

    @property
    def numel(self) -> float:
        return self.rows * self.cols

    @property
    def full_numel(self) -> float:
        return self.full_rows * self.full_cols

    @property
    def two_d(self) -> bool:
        return self.role != "vector"


def rank_tensors(args: ModelArgs, layers: int, has_embedding: bool, has_head: bool, tp: int = 1
                 ) -> list[ParamTensor]:
    """The parameter tensors of a rank holding `layers` decoder blocks (and the embedding,
    the final norm and the head where it holds them), under tp: q/k/v, gate/up and their
    biases split by rows (column-parallel), o and down by columns (row-parallel), the
    vocabulary split, the norms whole. Sums to duoka.plan.memory's count of the rank.

    A MoE model's sparse layers (their share of `layers`) hold a router [E, dim], the shared
    expert's SwiGLU and its gate [1, dim], and the routed experts: all E of them, since FSDP2
    shards the experts / ep of an ep rank over dp_shard / ep ranks, experts / dp_shard per
    rank as without ep (duoka.plan.moe)."""
    h, i, hd = args.dim, args.intermediate_size, args.resolved_head_dim
    q, kv, v = args.n_heads * hd, args.n_kv_heads * hd, args.vocab_size

    def by_rows(role, rows, cols, count):
        return ParamTensor(role, rows / tp, cols, count, rows, cols)

    def by_cols(role, rows, cols, count):
        return ParamTensor(role, rows, cols / tp, count, rows, cols)

    # MoE layers among them: all of a MoE model's (its rank holds every layer: no pp), none when dense
    sparse = round(layers * len(args.moe_layers) / args.n_layers)
    dense = layers - sparse
    out = [by_rows("matrix", q, h, layers), by_rows("matrix", kv, h, 2 * layers), by_cols("matrix", h, q, layers),
           by_rows("matrix", i, h, 2 * dense), by_cols("matrix", h, i, dense), by_rows("vector", q, 1, layers),
           by_rows("vector", kv, 1, 2 * layers), ParamTensor("vector", h, 1, 2 * layers, h, 1)]
    if sparse:
        e, m, s = args.num_experts, args.moe_intermediate_size, args.shared_expert_intermediate_size
        out += [ParamTensor("matrix", e, h, sparse, e, h), ParamTensor("matrix", 1, h, sparse, 1, h),
                by_rows("matrix", s, h, 2 * sparse), by_cols("matrix", h, s, sparse),
                ParamTensor("experts", e * m, h, 2 * sparse, e * m, h), ParamTensor("experts", e * h, m, sparse, e * h, m)]
    if has_embedding:
        out.append(by_rows("embedding", v, h, 1))
    if has_head:
        out.append(ParamTensor("vector", h, 1, 1, h, 1))
        if not (args.tie_word_embeddings and has_embedding):
            out.append(by_rows("head", v, h, 1))
    return [t for t in out if t.count]


# ---------------------------------------------------------------- state and step


@dataclass(frozen=True)
class Footprint:
    """An optimizer on one rank: bytes (and the step's work) summed over its tensors."""

    gpu_state: float  # optimizer state on the GPU
    host: float  # host memory: offloaded state and the pinned weight and gradient copies
    pinned: float  # of which page-locked
    step_transient: float  # what the step allocates on the GPU beyond the state, at its largest
    hbm_bytes: float  # bytes the step moves through the GPU's memory
    host_calls_s: float  # host time of the step's per-tensor calls
    serial: bool  # the step waits for the GPU between tensors (host and GPU do not overlap)
    matmul_flops: float  # Muon's Newton-Schulz matmuls
    offloaded: float  # elements whose AdamW runs on the host
    gathered: tuple[tuple[float, int], ...] = ()  # (fp32 bytes of a whole matrix, count) gathered per step

    @property
    def host_step_bytes(self) -> float:
        return HOST_ADAMW_BYTES * self.offloaded


def _quantized(local_rows: int, cols: float, spec: Quantized) -> bool:
    n = local_rows * cols
    return n >= TORCHAO_MIN_NUMEL and n % spec.block == 0


def footprint(tensors: list[ParamTensor], choice: OptimizerChoice, shard: int = 1) -> Footprint:
    """The optimizer's state and step on a rank holding `tensors`, each sharded over `shard`
    FSDP2 ranks (dim 0; torchao decides per local shard, sized for the rank with the most
    rows), as duoka.train.optimizers builds it: AdamW and SGD fused, Adafactor and Muon's
    AdamW foreach (a tensor list of temporaries per parameter group), torchao's step
    compiled (training.compile, the default on GPUs), Muon on whole matrices gathered on
    every rank (WholeMatrixMuon)."""
    gpu = host = pinned = transient = hbm = calls = flops = offloaded = 0.0
    gathered = []
    groups = {"2d": 0.0, "1d": 0.0}  # elements of the foreach groups: matrices (decayed), vectors
    name = choice.name
    for t in tensors:
        n = t.numel / shard  # elements of one such tensor on this rank
        local_rows = math.ceil(t.rows / shard)
        if choice.offloaded:
            if t.numel >= OFFLOAD_MIN_NUMEL:
                host += OFFLOAD_HOST_BYTES * n * t.count
                pinned += OFFLOAD_PINNED_BYTES * n * t.count
                offloaded += n * t.count
            else:
                gpu += ADAMW_STATE_BYTES * n * t.count
                hbm += STEP_HBM_BYTES["adamw"] * n * t.count
        elif name in QUANTIZED:
            spec = QUANTIZED[name]
            if _quantized(local_rows, t.cols, spec):
                per = 2 * (spec.code_bytes * n + FP32 * n / spec.block + FP32 * spec.qmap_entries)
                transient = max(transient, TORCHAO_STEP_TRANSIENT[name] * n)
            else:
                per = ADAMW_STATE_BYTES * n
            gpu += per * t.count
            hbm += STEP_HBM_BYTES[name] * n * t.count
            calls += TORCHAO_CALL_S * t.count
        elif name == "adafactor":
            # row_var (rows x 1) and col_var (1 x cols) of a matrix; a vector's variance whole
            gpu += FP32 * ((t.rows / shard + t.cols) if t.two_d else n) * t.count
            groups["2d" if t.two_d else "1d"] += n * t.count
            hbm += STEP_HBM_BYTES[name] * n * t.count
            calls += ADAFACTOR_TENSOR_S * t.count
        elif name == "muon" and t.role == "matrix":
            gpu += FP32 * n * t.count  # momentum_buffer, sharded like the weight
            hbm += STEP_HBM_BYTES[name] * n * t.count
            calls += MUON_TENSOR_S * t.count
            whole = t.full_numel
            m, k = sorted((t.full_rows, t.full_cols))
            # Every rank orthogonalises every whole matrix it holds part of. Per Newton-Schulz
            # step: X X^T (2 m^2 k), the quintic's B @ B (2 m^3), B @ X (2 m^2 k).
            flops += choice.ns_steps * (4 * m * m * k + 2 * m ** 3) * t.count
            # Nesterov update (fp32: the local one, and the gathered whole when sharded), the
            # whole's bf16 copy and next iterate (2 + 2), the m x m Gram matrix and polynomial
            sharded = n < whole
            transient = max(transient, FP32 * n * sharded + FP32 * whole + 4 * whole + 4 * m * m)
            if sharded:
                gathered.append((FP32 * whole, t.count))
        elif name in ("adamw", "muon"):  # muon: AdamW (foreach) for the embedding, the head, norms, biases
            gpu += ADAMW_STATE_BYTES * n * t.count
            groups["2d" if t.two_d else "1d"] += n * t.count
            hbm += STEP_HBM_BYTES["adamw"] * n * t.count
        elif name == "sgd":
            with_momentum = choice.sgd_momentum > 0
            gpu += (FP32 * n if with_momentum else 0.0) * t.count
            groups["2d" if t.two_d else "1d"] += n * t.count
            hbm += (STEP_HBM_BYTES["sgd"] if with_momentum else SGD_PLAIN_HBM_BYTES) * n * t.count
    if name in FOREACH:
        # a list of fp32 temporaries as large as the group's parameters (Adafactor's
        # var_estimates, AdamW's exp_avg_sq_sqrt), one parameter group at a time
        transient = max(transient, FP32 * max(groups.values()))
    if name == "sgd" and choice.weight_decay > 0:
        transient = max(transient, FP32 * groups["2d"])
    return Footprint(gpu_state=gpu, host=host, pinned=pinned, step_transient=transient, hbm_bytes=hbm,
                     host_calls_s=calls, serial=name == "adafactor", matmul_flops=flops, offloaded=offloaded,
                     gathered=tuple(gathered))


@lru_cache(maxsize=4096)
def rank_footprint(args: ModelArgs, layers: int, has_embedding: bool, has_head: bool, tp: int,
                   choice: OptimizerChoice, shard: int) -> Footprint:
    """footprint(rank_tensors(...), choice, shard), remembered: a plan asks for the same
    few ranks across thousands of (layout, micro-batch) candidates."""
    return footprint(rank_tensors(args, layers, has_embedding, has_head, tp), choice, shard)


def step_seconds(fp: Footprint, hbm_bytes_per_s: float, matmul_flops_per_s: float, backward_s: float) -> float:
    """Seconds the optimizer step adds to a training step.

    On the GPU: its memory traffic and matmuls, overlapped with the host's per-tensor calls
    unless the step waits for the GPU between tensors (Adafactor's .item()), then added.
    Offloaded: each micro-batch's backward hook copies the gradients to the host as they are
    produced; what the last backward (`backward_s`) does not hide waits. Then the host's AdamW
    runs tensor by tensor while the updated weights go back to the GPU behind it: the slower
    of the two."""
    gpu = fp.hbm_bytes / hbm_bytes_per_s + fp.matmul_flops / matmul_flops_per_s
    t = gpu + fp.host_calls_s if fp.serial else max(gpu, fp.host_calls_s)
    if fp.offloaded:
        copy = FP32 * fp.offloaded / PCIE_BYTES_PER_S  # every gradient down, or every weight up
        host = fp.host_step_bytes / HOST_ADAMW_BYTES_PER_S
        t += max(0.0, copy - backward_s) + max(host, copy)
    return t
