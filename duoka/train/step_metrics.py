"""Per-step metrics: every rank's figures gathered in one collective, one record built
from them (docs/monitoring.md's metrics.jsonl fields plus `per_rank`, `gpus`, `phase_s`, `host_s`,
`balance`, `alerts`), and that record handed to every sink, the alerts and the console.

RankFigures is the one schema: what a rank measures, what travels in the gather, and
what the record reads. GPU readings keep GpuSample's field names end to end.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.errors import DuokaError
from duoka.monitor.alerts import Alert, ExpertCollapse, health_alerts
from duoka.monitor.alerts import check as check_alerts
from duoka.monitor.expert_load import summarize as summarize_expert_load
from duoka.monitor.gpu import GpuSample, GpuSampler, decode_clock_reasons, index_of_uuid, load_nvml
from duoka.monitor.mfu import mfu
from duoka.monitor.sinks import MetricsFile, PrometheusSink, TensorBoardSink
from duoka.state_files import cut_torn_tail, read_jsonl, write_whole
from duoka.train.run_files import RESTARTS_LOG

# GpuSample fields carried per rank; the two masks are decoded into word lists in the record.
GPU_FIELDS = ("index", "utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w",
              "sm_clock_mhz", "clock_mask", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "nvlink_tx_bytes_per_s",
              "nvlink_rx_bytes_per_s", "sm_active_pct", "sm_occupancy_pct", "throttle_mask")
_INTEGER_GPU_FIELDS = {"index", "utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c",
                       "sm_clock_mhz", "clock_mask", "throttle_mask"}
# The first steps of a process compile, fill the data queue and warm the allocator: no alerts from them.
ALERT_WARMUP_STEPS = 3


@dataclass
class RankFigures:
    """One rank's figures for one step. NaN: not measured on this rank (CPU, no NVML)."""

    loss_sum: float = 0.0  # summed cross-entropy; 0 on ranks that do not count (see counts_for_metrics)
    tokens: float = 0.0  # target tokens; idem
    step_time: float = math.nan
    data_time: float = math.nan
    samples: float = 0.0
    compute_s: float = 0.0  # the load balancer's timed compute (0 without it)
    stop: bool = False  # a stop was asked on this rank (SIGTERM)
    save_done: bool = False  # this rank's background checkpoint write has finished
    peak_gib: float = math.nan
    active_gib: float = math.nan
    alloc_retries: float = math.nan
    ooms: float = math.nan
    gpu: dict = field(default_factory=dict)  # GPU_FIELDS -> value; empty without an NVML reading

    @classmethod
    def _scalars(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "gpu"]

    def pack(self) -> torch.Tensor:
        values = [float(getattr(self, k)) for k in self._scalars()]
        values += [float(self.gpu[k]) if self.gpu.get(k) is not None else math.nan for k in GPU_FIELDS]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def unpack(cls, row: torch.Tensor) -> RankFigures:
        names, values = cls._scalars(), row.tolist()
        flags = {f.name for f in fields(cls) if f.type == "bool"}  # annotations are strings here
        scalars = {k: v > 0 if k in flags else v for k, v in zip(names, values)}
        gpu = {k: int(v) if k in _INTEGER_GPU_FIELDS else v
               for k, v in zip(GPU_FIELDS, values[len(names):]) if not math.isnan(v)}
        return cls(**scalars, gpu=gpu)


def gpu_reading(rank: int, figures: RankFigures) -> dict:
    """A rank's entry in metrics.jsonl's `gpus` list."""
    g = {k: figures.gpu.get(k) for k in GPU_FIELDS}
    clock, throttle = g.pop("clock_mask"), g.pop("throttle_mask")
    return {"rank": rank, **g, "clock_reasons": decode_clock_reasons(clock), "throttled": decode_clock_reasons(throttle)}


class StepMetrics:
    """Gathers the per-rank figures, builds the step's record and sends it out: metrics.jsonl
    and TensorBoard on rank 0, a Prometheus endpoint on each node's first rank (covering
    that node's ranks), alerts and the console line."""

    def __init__(self, cfg, run_dir: Path, rank: int, world: int, device: torch.device, n_params: int,
                 flops_per_token: float, peak: float | None, start_step: int, steps: int, console, moe=None):
        """moe: a MoE model's ModelArgs (its expert load is summarised and watched); None when dense."""
        self.cfg, self.run_dir, self.rank, self.world, self.device = cfg, run_dir, rank, world, device
        self.n_params, self.flops_per_token, self.peak = n_params, flops_per_token, peak
        self.start_step, self.steps, self.console = start_step, steps, console
        self.moe_layers = moe.moe_layers if moe is not None else ()
        self.collapse = (ExpertCollapse(moe.num_experts, moe.num_experts_per_tok, moe.router_aux_loss_coef,
                                        moe.router_aux_loss) if self.moe_layers else None)
        # The rows travel on the host: a gloo group never queues behind the GPU's work.
        self.group = dist.new_group(backend="gloo")
        self.active_alerts: set[str] = set()
        if rank == 0:
            truncate_metrics(run_dir / "metrics.jsonl", start_step, console.print)
        # Automatic restarts of this run so far (--max-restarts; node 0's launcher logs each
        # one before it starts the group again).
        restarts = run_dir / RESTARTS_LOG
        self.restarts = len(read_jsonl(restarts)[0]) if restarts.exists() else 0
        self.sinks = self._open_sinks()
        self.gpu_sampler = self._gpu_sampler()

    def _open_sinks(self) -> list:
        cfg, sinks = self.cfg.metrics, []
        if self.rank == 0:
            sinks.append(MetricsFile(self.run_dir / "metrics.jsonl"))
            if cfg.tensorboard:
                sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if cfg.prometheus_port and int(os.environ.get("LOCAL_RANK", 0)) == 0:
            first = self.rank  # local rank 0: ranks are numbered node by node
            try:
                sink = PrometheusSink(cfg.prometheus_host, cfg.prometheus_port, list(range(first, first + local_world)))
            except OSError as e:
                raise DuokaError(f"metrics.prometheus_port={cfg.prometheus_port} on {cfg.prometheus_host} cannot be "
                                 f"opened ({e})", "choose a free port, or 0 to turn the endpoint off") from None
            sinks.append(sink)
            self.console.print(f"Prometheus metrics on http://{cfg.prometheus_host}:{sink.port}/metrics")
        return sinks

    def _gpu_sampler(self) -> GpuSampler | None:
        """Each rank reads its own GPU through NVML, found by UUID (NVML ignores CUDA_VISIBLE_DEVICES)."""
        if self.device.type != "cuda":
            return None
        nvml = load_nvml()
        index = index_of_uuid(nvml, str(torch.cuda.get_device_properties(self.device).uuid)) if nvml else None
        if index is None:  # monitoring only: say so once and train on
            self.console.print("[yellow]NVML cannot read this GPU: no per-GPU readings in the metrics[/]")
            return None
        return GpuSampler(nvml, [index], self.cfg.metrics.gpu_interval_s)

    def gpu_figures(self) -> dict:
        if self.gpu_sampler is None:
            return {}
        sample: GpuSample = self.gpu_sampler.latest()[0]
        return {k: getattr(sample, k) for k in GPU_FIELDS}

    def gather(self, mine: RankFigures) -> list[RankFigures]:
        """Every rank's figures, in rank order (one all-gather on the host)."""
        row = mine.pack()
        gathered = [torch.zeros_like(row) for _ in range(self.world)]
        dist.all_gather(gathered, row, group=self.group)
        return [RankFigures.unpack(r) for r in gathered]

    def expert_load(self, step: int, counts: torch.Tensor) -> dict:
        """The step's `expert_load` from this rank's [MoE layers, E] counts: every rank's summed
        by one all_reduce on the host group, which every rank of a MoE run calls once per step,
        right after `gather`. Ranks holding the same layer's routing twice (tp ranks) add it
        to every layer alike: the shares, per layer, are unchanged. Full shares on the steps
        the console reports (log_interval), to keep metrics.jsonl small."""
        total = counts.to(torch.float64)  # a copy: the step's own tensor is left as it is
        dist.all_reduce(total, group=self.group)
        return summarize_expert_load(total, self.moe_layers, shares=self._reported(step))

    def _reported(self, step: int) -> bool:
        """The steps with a console line (and the expert load's full shares)."""
        return step % self.cfg.metrics.log_interval == 0 or step == self.steps or step == self.start_step + 1

    def record(self, step: int, ranks: list[RankFigures], tokens_seen: int, lr: float, grad_norm: float) -> dict:
        """The metrics.jsonl line from the gathered figures."""
        slowest = max(r.step_time for r in ranks)  # a synchronous step takes as long as its slowest rank
        tokens = sum(r.tokens for r in ranks)
        tps = tokens / slowest
        rank_loss = [r.loss_sum / r.tokens if r.tokens > 0 else None for r in ranks]
        record = {
            "step": step,
            "loss": sum(r.loss_sum for r in ranks) / tokens,
            "loss_max_rank": _largest([x for x in rank_loss if x is not None]),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens_seen,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / self.world,
            "mfu": mfu(self.flops_per_token, tps, self.world, self.peak),
            "step_time_s": slowest,
            "data_time_s": max(r.data_time for r in ranks),
            "restarts": self.restarts,
            "per_rank": {
                "loss": rank_loss,
                "step_time_s": [r.step_time for r in ranks],
                "data_time_s": [r.data_time for r in ranks],
            },
        }
        if self.device.type == "cuda":  # the largest over ranks (pipeline stages differ)
            record["peak_mem_gib"] = max(r.peak_gib for r in ranks)
            for key, name in (("peak_mem_gib", "peak_gib"), ("active_mem_gib", "active_gib"),
                              ("alloc_retries", "alloc_retries"), ("ooms", "ooms")):
                record["per_rank"][key] = [getattr(r, name) for r in ranks]
        if ranks[0].gpu:
            record["gpus"] = [gpu_reading(rank, r) for rank, r in enumerate(ranks)]
        return record

    def publish(self, record: dict, elapsed: float, announced: tuple[Alert, ...] | list[Alert] = ()) -> None:
        """Alerts (each logged once when it starts), every sink, and the console line.
        `announced`: alerts their component already printed when they arose (a stall's)."""
        if self.cfg.metrics.alerts:
            record["alerts"] = self._alerts(record) + [a.to_dict() for a in announced]
        for sink in self.sinks:
            sink.write(record)
        if self._reported(record["step"]):
            self.console.progress(record, self.steps, elapsed, self.start_step)

    def _alerts(self, record: dict) -> list[dict]:
        found = health_alerts(record)
        if record["step"] > self.start_step + ALERT_WARMUP_STEPS:
            found += check_alerts(record, self.n_params)
        if self.collapse is not None:  # needs COLLAPSE_STEPS in a row: no warm-up of its own
            found += self.collapse.check(record)
        for a in found:
            if a.kind not in self.active_alerts:
                self.console.print(f"[bold yellow]alert ({a.kind})[/]: {a.message}")
        self.active_alerts = {a.kind for a in found}
        return [a.to_dict() for a in found]

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.gpu_sampler is not None:
            self.gpu_sampler.close()


def _largest(values: list[float]) -> float | None:
    """The largest value, NaN if any is NaN (Python's max would depend on the order)."""
    if any(math.isnan(x) for x in values):
        return math.nan
    return max(values, default=None)


def memory_figures(device: torch.device) -> dict:
    """The step's allocator figures, read when its work is launched (the allocator counts on
    the host, so they are already final) and before the next step resets the peak."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "active_gib": torch.cuda.memory_allocated(device) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}


def truncate_metrics(path: Path, last_step: int, warn=None) -> None:
    """On resume, drop records past the checkpoint (a run that died after logging steps it
    never saved) and a torn last line (a write cut short by a full disk or a kill, said
    through warn): metrics.jsonl then holds each step once, as if never interrupted."""
    if not path.exists():
        return
    cut_torn_tail(path, warn)
    records, _ = read_jsonl(path)
    kept = [r for r in records if r.get("step", 0) <= last_step]
    if len(kept) != len(records):
        write_whole(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
