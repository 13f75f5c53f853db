"""What a plan is made of and how it is written down: a `Candidate` (one layout, micro-batch
and checkpointing with its memory and step time), the `Plan` (the ranked candidates and why
the first is first), their JSON (`to_dict`), and the recommended config as TOML for
`duoka train` (`plan_toml`, with the names of duoka.config).

How candidates are made and ranked: duoka.plan.ranking; the tables: duoka.plan.render.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duoka.config import toml_value
from duoka.plan.hardware import Hardware
from duoka.plan.layouts import family
from duoka.plan.memory import GIB, Layout, MemoryBreakdown
from duoka.plan.model_choice import ModelChoice
from duoka.plan.optimizer_costs import ADAMW, OptimizerChoice
from duoka.plan.step_time import StepTime


def gib_text(x: float) -> str:
    """Bytes as GiB with one decimal, as the plan's text gives them."""
    return f"{x / GIB:.1f}"


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    micro_batch: int
    activation_checkpointing: bool
    accumulation: int  # micro-batches per step per rank (pipeline micro-batches under pp)
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    optimizer: OptimizerChoice = ADAMW
    fused_loss: bool = False  # training.fused_loss: planned with every checkpointed layout that runs it

    @property
    def family(self) -> str:
        return family(self.layout)

    def describe(self, optimizer: bool = True) -> str:
        ac = (", checkpointing" if self.activation_checkpointing else "") + (", fused loss" if self.fused_loss else "")
        opt = f", {self.optimizer.describe()}" if optimizer and self.optimizer != ADAMW else ""
        return f"{self.layout.describe()}, micro-batch {self.micro_batch}{ac}{opt}"

    def to_dict(self, relative_to: float | None = None) -> dict:
        lay = self.layout
        d = {"layout": lay.describe(), "family": self.family,
             "parallel": {"dp_mode": lay.dp_mode, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
                          "tp": lay.tp, "pp": lay.pp, "pp_schedule": lay.pp_schedule,
                          "pp_stages_per_rank": lay.stages_per_rank,
                          "reshard_after_forward": lay.reshard_after_forward, "ep": lay.ep, "cp": lay.cp,
                          "cp_method": lay.cp_method},
             "micro_batch": self.micro_batch, "accumulation": self.accumulation,
             "activation_checkpointing": self.activation_checkpointing, "fused_loss": self.fused_loss,
             "optimizer": self.optimizer.config(),
             "fits": self.fits, "peak_allocated_gib": round(self.memory.allocated / GIB, 2),
             "reserved_gib": round(self.memory.reserved / GIB, 2), "host_gib": round(self.memory.host / GIB, 2),
             "memory": self.memory.to_dict(), "step_time": self.time.to_dict()}
        if relative_to:
            d["relative_step_time"] = round(self.time.total_s / relative_to, 3)
        return d


@dataclass
class Plan:
    model: ModelChoice
    hardware: Hardware
    seq_len: int
    global_batch: int
    ranked: list[Candidate]  # the best variant of each fitting layout; [0] is the recommendation
    rejected: list[Candidate]  # the smallest-memory variant of each layout that does not fit
    why: str
    considered: int  # (layout, micro-batch, checkpointing) combinations estimated
    notes: list[str] = field(default_factory=list)
    optimizer: OptimizerChoice = ADAMW  # the optimizer planned with
    # Set when AdamW did not fit and the planner chose the optimizer: why, and the best
    # candidate of every optimizer that fits (in duoka.plan.ranking.PROPOSAL_ORDER).
    proposal: str = ""
    alternatives: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def fastest_s(self) -> float:
        return min(c.time.total_s for c in self.ranked)

    def config_toml(self) -> str:
        return plan_toml(self)

    def to_dict(self) -> dict:
        hw = self.hardware
        return {
            "model": self.model.label, "parameters": self.model.args.num_params(),
            "hardware": {"gpus": hw.gpus, "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node,
                         "gpu_memory_gib": hw.gpu_memory_gib, "interconnect": hw.interconnect,
                         "gpu_name": hw.gpu_name, "peak_tflops": hw.peak_flops / 1e12, "detected": list(hw.detected),
                         "usable_gib": round(hw.usable_bytes / GIB, 2)},
            "seq_len": self.seq_len, "global_batch": self.global_batch, "considered": self.considered,
            "optimizer": self.optimizer.config(), "proposal": self.proposal,
            "alternatives": [c.to_dict(self.fastest_s) for c in self.alternatives],
            "why": self.why, "notes": self.notes,
            "ranked": [c.to_dict(self.fastest_s) for c in self.ranked],
            "rejected": [c.to_dict() for c in self.rejected],
            "config_toml": self.config_toml(),
        }


def optimizer_keys(opt: OptimizerChoice) -> str:
    """The settings that select `opt`, as the plan names them: `optimizer.name = "adamw8bit", ...`."""
    return ", ".join(f"optimizer.{k} = {toml_value(v)}" for k, v in opt.config().items())


def plan_toml(plan: Plan) -> str:
    """The recommendation as a config for `duoka train` (the names of duoka.config)."""
    c, hw = plan.best, plan.hardware
    lay = c.layout
    launch = f"--nproc-per-node {hw.gpus_per_node}"
    if hw.nodes > 1:
        launch += f" --nnodes {hw.nodes} --node-rank R --rdzv-endpoint HOST:PORT"
    lines = [(f"# duoka plan: {plan.model.label} on {hw.describe()}, seq {plan.seq_len}, "
              f"global batch {plan.global_batch}"),
             f"# {c.describe()}; accumulation {c.accumulation}",
             *([f"# optimizer {plan.optimizer.describe()}: AdamW does not fit (duoka plan's proposal)"]
               if plan.proposal else []),
             (f"# estimated peak per GPU: {gib_text(c.memory.allocated)} GiB allocated, "
              f"{gib_text(c.memory.reserved)} GiB reserved, of {hw.gpu_memory_gib:g} GiB"),
             f"# duoka train THIS.toml {launch}", ""]
    sections: dict[str, dict] = {"model": dict(plan.model.config)}
    if "flavor" in plan.model.config and plan.model.config["flavor"] != "debug":
        lines[-1:-1] = ["# A flavor trains from scratch, here on random tokens: set data.path to your corpus",
                        "# and model.tokenizer to a Qwen2 tokenizer folder, or model.path to a checkpoint."]
        sections["data"] = {"path": "random"}
    sections["training"] = {"seq_len": plan.seq_len, "global_batch_size": plan.global_batch,
                            "micro_batch_size": c.micro_batch,
                            "activation_checkpointing": "full" if c.activation_checkpointing else "none",
                            "dtype": "bf16", **({"fused_loss": True} if c.fused_loss else {})}
    par = {"dp_mode": lay.dp_mode, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
           "pp": lay.pp}
    if lay.fsdp and not lay.reshard_after_forward:
        par["reshard_after_forward"] = False
    if lay.ep > 1:
        par["ep"] = lay.ep
    if lay.cp > 1:
        par.update(cp=lay.cp, cp_method=lay.cp_method)
    if lay.pp > 1:
        par.update(pp_schedule=lay.pp_schedule, pp_stages_per_rank=lay.stages_per_rank, pp_layers="even",
                   pp_microbatches=c.accumulation)
    sections["parallel"] = par
    if plan.optimizer != ADAMW:
        sections["optimizer"] = plan.optimizer.config()
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)
