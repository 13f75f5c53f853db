"""The optimizer as one component of the trainer: which algorithm updates the weights
(optimizer.name), where AdamW's state lives (optimizer.offload), and what cannot be combined.

    build_optimizer(model, cfg, lr, device_type, compiled) -> TrainingOptimizer
        .set_lr(lr)   each parameter group's lr_scale x the schedule's lr
        .step(), .zero_grad()
        clip_to_norm(optimizer, ...) and Health.allow_update read .defaults["fused"]: a fused
        optimizer takes the clip (grad_scale) and the skip (found_inf) inside its kernels
        iterating over it gives its torch optimizers: DCP's get/set_optimizer_state_dict take them
    check_optimizer(cfg, dims, on_gpu, lora)   refusals, before any worker starts
    check_resume(path, train_state, cfg)        a checkpoint resumes with the optimizer it was saved by

Every optimizer is a library's: PyTorch's AdamW, Adafactor, SGD and Muon, torchao's AdamW8bit,
AdamW4bit and CPUOffloadOptimizer. The one piece of our own is Muon's step on sharded
parameters (WholeMatrixMuon): Newton-Schulz needs each whole matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from duoka import runtime
from duoka.config import OptimizerConfig
from duoka.errors import QUANT_INSTALL, DuokaError
from duoka.parallel.dims import ParallelDims
from duoka.parallel.dtensor import by_mesh, full_value
from duoka.parallel.parallelize import unwrap

LOW_BIT = ("adamw8bit", "adamw4bit")
# Muon's update scaled to AdamW's RMS, 0.2 * sqrt(max(rows, cols)) (Liu et al., "Muon is Scalable
# for LLM Training", arXiv:2502.16982): optimizer.lr and weight_decay tuned for AdamW carry over.
MUON_LR_ADJUSTMENT = "match_rms_adamw"


def check_optimizer(cfg, dims: ParallelDims, on_gpu: bool, lora: bool) -> None:
    """What an optimizer cannot be combined with, refused before launch with what would work."""
    o = cfg.optimizer
    if o.offload == "cpu":
        if o.name != "adamw":
            raise DuokaError(f"optimizer.offload=cpu offloads AdamW only, not optimizer.name={o.name}",
                             "use optimizer.name=adamw with offload=cpu, or offload=none (adamw8bit and adamw4bit "
                             "also shrink the state, on the GPU)")
        if not on_gpu:
            raise DuokaError("optimizer.offload=cpu moves the optimizer state from the GPU to host memory, and this "
                             "run has no GPU", "use optimizer.offload=none (on CPU the state is in host memory anyway)")
        if dims.world_size > 1:
            raise DuokaError(f"optimizer.offload=cpu is for one GPU (torchao's CPUOffloadOptimizer), and this run "
                             f"has {dims.world_size} processes ({dims.describe()})",
                             "on several GPUs shard the state instead: parallel.dp_mode=fsdp (with "
                             "optimizer.name=adamw8bit for less still); or run on one GPU")
    if o.name == "adafactor" and dims.fsdp:
        raise DuokaError(f"optimizer.name=adafactor needs each parameter whole on its rank: PyTorch's Adafactor "
                         f"cannot step parameters sharded as DTensors, as {dims.describe()} holds them (FSDP2, "
                         "and every tp or pp layout)",
                         "use parallel.dp_mode=ddp without tp or pp, or optimizer.name=adamw8bit (2 bytes of state "
                         "per parameter, sharded by FSDP2)")
    if o.name == "muon" and lora:
        raise DuokaError(f"optimizer.name=muon orthogonalises the update of whole weight matrices; LoRA (lora.rank="
                         f"{cfg.lora.rank}) trains low-rank factors of them instead",
                         "use optimizer.name=adamw (or adamw8bit) for LoRA runs")
    if o.name == "sgd" and o.nesterov and o.sgd_momentum == 0:
        raise DuokaError("optimizer.nesterov=true with optimizer.sgd_momentum=0: Nesterov momentum needs momentum",
                         "set optimizer.sgd_momentum > 0 (e.g. 0.9), or optimizer.nesterov=false")
    if o.name in LOW_BIT or o.offload == "cpu":
        _torchao_optim(o.name)  # raises when torchao is missing


def check_resume(path, train_state: dict, cfg) -> None:
    """A checkpoint holds the state of the optimizer that saved it: another one would find
    none of its own (or read another's moments as its own)."""
    saved = train_state.get("config", {}).get("optimizer", {}).get("name", "adamw")
    if saved != cfg.optimizer.name:
        raise DuokaError(f"{path} was saved by optimizer.name={saved}, and this run asks for "
                         f"optimizer.name={cfg.optimizer.name}: the checkpoint holds {saved}'s state",
                         f"resume with --optimizer.name={saved}, or start a new run (job.output_dir) from the "
                         "exported weights (model.path=RUN/hf/step-N)")


def _torchao_optim(name: str):
    """torchao.optim: an optional dependency, imported here only (name: what needs it)."""
    try:
        import torchao.optim
    except ImportError as e:
        what = f"optimizer.name={name}" if name in LOW_BIT else "optimizer.offload=cpu"
        raise DuokaError(f"{what} needs torchao, which is not installed ({e})",
                         f"{QUANT_INSTALL}, or use optimizer.name=adamw "
                         "with offload=none") from None
    return torchao.optim


def _low_bit_adamw(name: str, compiled: bool) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit or AdamW4bit. torchao compiles its step for each parameter shape
    (~25 s for the debug model on a CPU core): an uncompiled run (training.compile off, the
    default on CPU) gets the class with its step run eagerly. The class, not the trainer's call,
    holds this: DCP also steps the optimizer, to create the state a resume loads into."""
    ao = _torchao_optim(name)
    base = ao.AdamW8bit if name == "adamw8bit" else ao.AdamW4bit
    if compiled:
        return base

    class Eager(base):
        @torch.no_grad()
        def step(self, closure=None):
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

    Eager.__name__ = Eager.__qualname__ = f"Eager{base.__name__}"
    return Eager


def _newton_schulz():
    """PyTorch's Muon keeps its Newton-Schulz iteration and lr adjustment private
    (torch.optim._muon); WholeMatrixMuon calls them on gathered matrices. The one place
    duoka reaches for them (tests/unit/test_optimizers.py checks they still exist)."""
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
    except ImportError as e:
        raise DuokaError(f"optimizer.name=muon needs torch.optim._muon's Newton-Schulz iteration, which PyTorch "
                         f"{torch.__version__} does not have ({e})",
                         "use optimizer.name=adamw, or the PyTorch version duoka pins") from None
    return _zeropower_via_newtonschulz, _adjust_lr


class WholeMatrixMuon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, state and checkpoint format) whose step also takes
    parameters sharded as DTensors (FSDP2 over rows, tp by rows or columns): the momentum
    stays sharded like the parameter; the update to orthogonalise is gathered whole on
    every rank (full_tensor), orthogonalised there, and each rank keeps its own slice
    (distribute_tensor with src_data_rank=None slices locally, no communication). The step
    is torch's _single_tensor_muon, operation for operation, so a plain tensor steps as
    torch's Muon steps it, and one process computes what every layout computes."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._orthogonalise, self._adjust_lr = _newton_schulz()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("WholeMatrixMuon.step takes no closure")
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                whole = self._orthogonalise(full_value(update), group["ns_coefficients"], group["ns_steps"],
                                            group["eps"])
                if isinstance(p, DTensor):
                    whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(whole, alpha=-self._adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class OffloadedAdamW(torch.optim.Optimizer):
    """torchao's CPUOffloadOptimizer (one GPU): each gradient is copied to pinned host memory
    as backward produces it, AdamW (fused, on the CPU) steps the host's fp32 master copy, and
    the weights are copied back; parameters under 4,096 values stay on the GPU with their own
    fused AdamW. Seen from outside as an optimizer over the model's own parameters, which is
    what DCP maps to parameter names, with a fused optimizer's hooks (grad_scale, found_inf)
    handed to every inner AdamW: the gradients reach the host before the clip is known, so
    the clip is applied there, inside the host's step."""

    def __init__(self, groups: list[dict], ao, **adamw):
        super().__init__(groups, dict(adamw, fused=True))
        self.offload = ao.CPUOffloadOptimizer([dict(g, params=list(g["params"])) for g in self.param_groups],
                                              optimizer_class=torch.optim.AdamW, fused=True, **adamw)
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        # Each model parameter -> (its AdamW, the tensor that AdamW steps: the host copy, or itself).
        self._inner = {p: (opt, self.offload.param_d2h_map[p]) for p, opt in self.offload.optim_dict.items()}
        # (an inner AdamW's group, the group here whose lr it follows)
        self._lr_links = [(opt.param_groups[0], group_of[p]) for p, opt in self.offload.optim_dict.items()]
        if self.offload.d_opt is not None:
            for g in self.offload.d_opt.param_groups:
                self._lr_links.append((g, group_of[g["params"][0]]))
                self._inner.update({p: (self.offload.d_opt, p) for p in g["params"]})
        self._optimizers = list({id(o): o for o, _ in self._inner.values()}.values())

    def _amp(self, name: str, value: torch.Tensor) -> None:
        # Copied to the host once per step: the offloaded step waits for the GPU anyway.
        on = {}
        for opt in self._optimizers:
            device = opt.param_groups[0]["params"][0].device
            if device not in on:
                on[device] = value.to(device)
            setattr(opt, name, on[device])

    grad_scale = property(None, lambda self, value: self._amp("grad_scale", value))
    found_inf = property(None, lambda self, value: self._amp("found_inf", value))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        for inner, outer in self._lr_links:
            inner["lr"] = outer["lr"]
        self.offload.step()
        self._expose_state()

    def _expose_state(self) -> None:
        """DCP reads the state through the model's parameters: the inner AdamWs' own dicts."""
        for p, (opt, stepped) in self._inner.items():
            if stepped in opt.state:
                self.state[p] = opt.state[stepped]

    def zero_grad(self, set_to_none: bool = True):
        self.offload.zero_grad(set_to_none=True)

    def state_dict(self):
        """PyTorch's format over the model's parameters. DCP loads into existing tensors, so a
        fresh optimizer's state (a resume) is first created as DCP creates any optimizer's:
        a step at lr 0 on zero gradients (its step count is then overwritten by the load)."""
        for opt in self._optimizers:
            stepped = [p for g in opt.param_groups for p in g["params"]]
            if all(p in opt.state for p in stepped):
                continue
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = 0.0
            for p in stepped:  # the host copies' gradients are pinned buffers: zeroed, not replaced
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()
            opt.step()
            for g, lr in zip(opt.param_groups, saved):
                g["lr"] = lr
            if opt is self.offload.d_opt:
                opt.zero_grad(set_to_none=True)
        self._expose_state()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """Copy the loaded state into each inner AdamW's own tensors (on their devices), then
        refresh the host master copies from the weights the checkpoint just loaded."""
        # The saved groups list their parameters (DCP: by name; torch: by index) in the order of
        # ours, as torch's own load_state_dict pairs them.
        saved = [key for g in state_dict["param_groups"] for key in g["params"]]
        ours = dict(zip(saved, [p for g in self.param_groups for p in g["params"]]))
        for key, values in state_dict["state"].items():
            opt, stepped = self._inner[ours[key]]
            for key, value in values.items():
                opt.state[stepped][key].copy_(value)
        for p, host in self.offload.param_d2h_map.items():
            host.copy_(p.detach())


class TrainingOptimizer:
    """The torch optimizers that update the model, run by the trainer as one (Muon beside the
    AdamW for the rest; otherwise one). Built by build_optimizer; see the module doc."""

    def __init__(self, parts: list[torch.optim.Optimizer], name: str, fused: bool):
        self.parts, self.name, self.fused = parts, name, fused

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.parts)

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def defaults(self) -> dict:
        """What clip_to_norm and Health.allow_update read: whether the clip and the skip run
        inside the optimizer's own kernels (grad_scale, found_inf)."""
        return {"fused": self.fused}

    def _amp(self, name: str, value: torch.Tensor) -> None:
        if not self.fused:
            raise RuntimeError(f"{name} is read by fused optimizers only, and {self.name} is not one")
        for part in self.parts:
            setattr(part, name, value)

    # The AMP hooks (duoka.runtime.set_grad_divisor, set_found_inf), handed to every part.
    grad_scale = property(None, lambda self, value: self._amp("grad_scale", value))
    found_inf = property(None, lambda self, value: self._amp("found_inf", value))

    def set_lr(self, lr: float) -> None:
        """The schedule's lr for this step, times each group's lr_scale (muon's AdamW part
        runs at muon_adamw_lr / lr of it). torchao holds lr as a tensor: filled in place."""
        for group in self.param_groups:
            value = lr * group["lr_scale"]
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def describe(self) -> str:
        return self.name + (" (state offloaded to the CPU)" if isinstance(self.parts[0], OffloadedAdamW) else "")


def _groups(params: list[nn.Parameter], cfg: OptimizerConfig, lr_scale: float = 1.0) -> list[dict]:
    """Decoupled weight decay on matrices and embeddings only: decaying norm gains and biases
    pulls them toward zero for no regularisation benefit. Empty groups are left out."""
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "lr_scale": lr_scale},
              {"params": plain, "weight_decay": 0.0, "lr_scale": lr_scale}]
    return [g for g in groups if g["params"]]


def hidden_matrices(model: nn.Module) -> set[nn.Parameter]:
    """The decoder blocks' trained 2-D weights: what Muon updates (its authors leave
    embeddings, the head, norms and biases to AdamW)."""
    return {p for p in unwrap(model).layers.parameters() if p.requires_grad and p.dim() == 2}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, lr: float, device_type: str,
                    compiled: bool = False) -> TrainingOptimizer:
    """The configured optimizer over the model's trained parameters (a tied pair counted once).
    `compiled`: the run is compiled (training.compile as resolved), and torchao's step with it."""
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() yields a shared one once
    cuda = device_type == "cuda"
    betas = (cfg.beta1, cfg.beta2)
    if cfg.offload == "cpu":
        adamw = OffloadedAdamW(_groups(params, cfg), _torchao_optim(cfg.name), lr=lr, betas=betas, eps=cfg.eps)
        return TrainingOptimizer([adamw], cfg.name, fused=True)
    if cfg.name == "adamw":
        # Fused: one kernel for all parameters, the clip and the skip inside it; CPU uses foreach.
        adamw = torch.optim.AdamW(_groups(params, cfg), lr=lr, betas=betas, eps=cfg.eps, fused=cuda,
                                  foreach=None if cuda else True)
        return TrainingOptimizer([adamw], cfg.name, fused=cuda)
    if cfg.name in LOW_BIT:
        cls = _low_bit_adamw(cfg.name, compiled)
        return TrainingOptimizer([cls(_groups(params, cfg), lr=lr, betas=betas, eps=cfg.eps)], cfg.name, fused=False)
    if cfg.name == "adafactor":
        adafactor = torch.optim.Adafactor(_groups(params, cfg), lr=lr, foreach=True)
        return TrainingOptimizer([adafactor], cfg.name, fused=False)
    if cfg.name == "sgd":
        # Not fused: PyTorch's fused SGD leaves the momentum buffer uninitialised (torch.empty) when
        # its first step is skipped through found_inf, so a NaN at step 1 would poison every step after.
        sgd = torch.optim.SGD(_groups(params, cfg), lr=lr, momentum=cfg.sgd_momentum, nesterov=cfg.nesterov,
                              foreach=True)
        return TrainingOptimizer([sgd], cfg.name, fused=False)
    if cfg.name == "muon":
        matrices = hidden_matrices(model)
        muon = WholeMatrixMuon([{"params": [p for p in params if p in matrices], "lr_scale": 1.0}], lr=lr,
                               weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=cfg.nesterov,
                               ns_steps=cfg.muon_ns_steps, adjust_lr_fn=MUON_LR_ADJUSTMENT)
        rest = [p for p in params if p not in matrices]
        scale = cfg.muon_adamw_lr / cfg.lr if cfg.muon_adamw_lr and cfg.lr else 1.0
        # Not fused: Muon has no fused step, so the skip is decided on the host for both.
        adamw = torch.optim.AdamW(_groups(rest, cfg, scale), lr=lr * scale, betas=betas, eps=cfg.eps, foreach=True)
        return TrainingOptimizer([muon, adamw], cfg.name, fused=False)
    raise ValueError(f"unknown optimizer {cfg.name}")  # config choices make this unreachable


def clip_to_norm(optimizer: TrainingOptimizer, params: list[nn.Parameter], norm: torch.Tensor,
                 max_norm: float) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ does, given
    their global norm. A fused optimizer takes the scale into its own pass over the gradients,
    as the divisor `grad_scale` (the hook AMP's GradScaler unscales through). A separate
    multiply reads and writes every fp32 gradient once more (8.4 ms of a 7B step on an H200);
    the fused kernel writes the divided gradients back, so folding saves 2.9 of those ms.
    (Offloaded AdamW must fold: its gradients are on the host before the norm is known.)"""
    if not math.isfinite(max_norm):
        return
    if optimizer.defaults.get("fused"):
        runtime.set_grad_divisor(optimizer, torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0))
    else:
        for group in by_mesh(params):  # the scale is one tensor, which meets one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
