"""Where each step's metrics record goes: metrics.jsonl, TensorBoard event files and a
Prometheus endpoint. All three take the same record (the metrics.jsonl contract of docs/monitoring.md plus
`per_rank`, `gpus`, `balance` and `alerts`), so the three sinks never disagree.

Prometheus names follow its conventions: `duoka_*`, base units (seconds, bytes, ratios,
hertz, watts), labels of low cardinality only (rank, gpu, host, reason, kind, layer). One
endpoint per node, served by the node's first rank and covering the node's ranks; bound to
127.0.0.1 unless metrics.prometheus_host says otherwise.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import numpy as np

GIB = 2**30


class MetricsFile:
    """One JSON object per optimizer step, appended and flushed so `tail -f` and the monitor
    see each step as it completes. Strict JSON: a NaN or infinite figure is written as null
    (JSON has no such numbers, and strict parsers refuse Python's bare NaN)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:
            line = json.dumps(record, separators=(",", ":"), allow_nan=False)
        except ValueError:  # a non-finite figure somewhere: rare, so only then is the record copied
            line = json.dumps(_null_nonfinite(record), separators=(",", ":"), allow_nan=False)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _null_nonfinite(value: Any) -> Any:
    """`value` with every NaN or infinite float, however deep, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _null_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_null_nonfinite(v) for v in value]
    return value


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, r: dict) -> None:
        step, add = r["step"], self.writer.add_scalar
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s",
                    "data_time_s", "peak_mem_gib", "loss_max_rank"):
            if _finite(r.get(key)):
                add(f"train/{key}", r[key], step)
        for phase, seconds in r.get("phase_s", {}).items():
            add(f"phase_s/{phase}", seconds, step)
        per_rank = r.get("per_rank", {})
        for key, values in per_rank.items():
            for rank, v in enumerate(values):
                if _finite(v):
                    add(f"rank/{key}/{rank}", v, step)
        for g in r.get("gpus", []):
            for key in ("utilization_pct", "sm_active_pct", "memory_used_bytes", "temperature_c", "power_w",
                        "sm_clock_mhz"):
                if _finite(g.get(key)):
                    add(f"gpu/{key}/rank{g['rank']}", g[key], step)
        balance = r.get("balance")
        if balance:
            for rank, share in enumerate(balance["shares"]):
                add(f"balance/share/rank{rank}", share, step)
            for rank, speed in enumerate(balance["speed"]):
                if _finite(speed):
                    add(f"balance/speed/rank{rank}", speed, step)
        load = r.get("expert_load")
        if load:  # a MoE run (docs/monitoring.md, "Expert load")
            add("expert_load/max_imbalance", load["max_imbalance"], step)
            add("expert_load/min_effective_experts", load["min_effective_experts"], step)
            for i, layer in enumerate(load["layers"]):
                add(f"expert_load/imbalance/layer{layer}", load["imbalance"][i], step)
                add(f"expert_load/effective_experts/layer{layer}", load["effective_experts"][i], step)
                if "shares" in load:  # E values a layer, on the steps that carry the shares
                    self.writer.add_histogram(f"expert_load/shares/layer{layer}", np.asarray(load["shares"][i]), step)
        for alert in r.get("alerts", []):
            self.writer.add_text(f"alert/{alert['kind']}", alert["message"], step)

    def close(self) -> None:
        self.writer.close()


class PrometheusSink:
    """A prometheus-client registry of gauges served over HTTP; `ranks` are the global ranks
    this node's endpoint covers."""

    def __init__(self, host: str, port: int, ranks: list[int]):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.ranks, self.host = ranks, socket.gethostname()
        reg = self.registry = CollectorRegistry()
        self.server, self.thread = start_http_server(port, addr=host, registry=reg)
        self.port = self.server.server_port

        def g(name, doc, labels=()):
            return Gauge(name, doc, labels, registry=reg)

        self.scalars = {
            "step": g("duoka_step", "Optimizer steps completed"),
            "tokens": g("duoka_tokens", "Target tokens trained on so far"),
            "loss": g("duoka_loss", "Cross-entropy over the global batch (token-weighted)"),
            "loss_max_rank": g("duoka_loss_max_rank", "Largest per-rank cross-entropy of the step"),
            "grad_norm": g("duoka_grad_norm", "Global gradient L2 norm before clipping"),
            "lr": g("duoka_learning_rate", "Learning rate"),
            "tokens_per_s": g("duoka_tokens_per_second", "Training tokens per second, all GPUs"),
            "tokens_per_s_per_gpu": g("duoka_tokens_per_second_per_gpu", "Training tokens per second per GPU"),
            "mfu": g("duoka_mfu_ratio", "Model FLOPs utilisation (PaLM convention), 0..1"),
            "step_time_s": g("duoka_step_seconds", "Wall time of the step (slowest rank)"),
            "data_time_s": g("duoka_data_wait_seconds", "Time the step waited for its batch"),
        }
        self.phase = g("duoka_phase_seconds", "Rank 0's step time per phase", ["phase"])
        rank = ["rank", "host"]
        self.per_rank = {
            "loss": g("duoka_rank_loss", "Per-rank cross-entropy", rank),
            "step_time_s": g("duoka_rank_step_seconds", "Per-rank step wall time", rank),
            "data_time_s": g("duoka_rank_data_wait_seconds", "Per-rank data wait", rank),
            "peak_mem_gib": g("duoka_rank_peak_memory_bytes", "Per-rank peak allocated GPU memory", rank),
            "active_mem_gib": g("duoka_rank_active_memory_bytes", "Per-rank allocated GPU memory after the step", rank),
            "alloc_retries": g("duoka_rank_allocator_retries", "Per-rank CUDA caching-allocator retries (total)", rank),
            "ooms": g("duoka_rank_oom", "Per-rank CUDA out-of-memory events (total)", rank),
        }
        gpu = ["rank", "gpu", "host"]
        self.gpu = {
            "utilization_pct": (g("duoka_gpu_utilization_ratio", "NVML GPU utilisation, 0..1", gpu), 0.01),
            "sm_active_pct": (g("duoka_gpu_sm_active_ratio", "Share of SM cycles with work (NVML GPM), 0..1", gpu),
                              0.01),
            "sm_occupancy_pct": (g("duoka_gpu_sm_occupancy_ratio", "Share of warp slots in use (NVML GPM), 0..1",
                                   gpu), 0.01),
            "memory_used_bytes": (g("duoka_gpu_memory_used_bytes", "NVML memory used", gpu), 1),
            "memory_total_bytes": (g("duoka_gpu_memory_total_bytes", "NVML memory total", gpu), 1),
            "temperature_c": (g("duoka_gpu_temperature_celsius", "GPU temperature", gpu), 1),
            "power_w": (g("duoka_gpu_power_watts", "GPU power draw", gpu), 1),
            "sm_clock_mhz": (g("duoka_gpu_sm_clock_hertz", "SM clock", gpu), 1e6),
            "pcie_tx_bytes_per_s": (g("duoka_gpu_pcie_transmit_bytes_per_second", "PCIe sent", gpu), 1),
            "pcie_rx_bytes_per_s": (g("duoka_gpu_pcie_receive_bytes_per_second", "PCIe received", gpu), 1),
            "nvlink_tx_bytes_per_s": (g("duoka_gpu_nvlink_transmit_bytes_per_second", "NVLink data sent", gpu), 1),
            "nvlink_rx_bytes_per_s": (g("duoka_gpu_nvlink_receive_bytes_per_second", "NVLink data received", gpu),
                                      1),
        }
        self.throttle = g("duoka_gpu_throttled", "1 while NVML reports this clock-slowing reason",
                          ["rank", "gpu", "host", "reason"])
        self.share = g("duoka_balance_share_samples", "Samples of each global batch given to the rank", rank)
        self.speed = g("duoka_balance_speed_samples_per_second", "Rank's measured forward speed", rank)
        self.expert_imbalance = g("duoka_expert_imbalance_ratio", "MoE layer's busiest expert share x experts "
                                                                 "(1: even load)", ["layer"])
        self.expert_effective = g("duoka_expert_effective_experts", "MoE layer's exp(entropy) of the expert shares",
                                  ["layer"])
        self.alert = g("duoka_alert", "1 while an alert of this kind is active", ["kind"])
        self.skipped = g("duoka_skipped_steps", "Optimizer updates skipped so far (non-finite loss or gradient "
                                                "norm, or a skipped loss spike)")
        self._active_alerts: set[str] = set()
        self._throttled: set[tuple] = set()

    def write(self, r: dict) -> None:
        # A NaN loss or gradient norm is shown as NaN: keeping the last finite value would hide
        # a diverged run. None (not measured, e.g. MFU on CPU) leaves the gauge as it is.
        for key, gauge in self.scalars.items():
            if r.get(key) is not None:
                gauge.set(r[key])
        for phase, seconds in r.get("phase_s", {}).items():
            self.phase.labels(phase).set(seconds)
        per_rank = r.get("per_rank", {})
        for key, gauge in self.per_rank.items():
            scale = GIB if key.endswith("_gib") else 1
            for rank in self.ranks:
                values = per_rank.get(key)
                if values and rank < len(values) and values[rank] is not None:
                    gauge.labels(str(rank), self.host).set(values[rank] * scale)
        throttled = set()
        for s in r.get("gpus", []):
            if s["rank"] not in self.ranks:
                continue
            labels = (str(s["rank"]), str(s["index"]), self.host)
            for key, (gauge, scale) in self.gpu.items():
                if _finite(s.get(key)):
                    gauge.labels(*labels).set(s[key] * scale)
            throttled |= {(*labels, reason) for reason in s.get("throttled", [])}
        for labels in throttled | self._throttled:  # a reason that ended goes back to 0
            self.throttle.labels(*labels).set(1 if labels in throttled else 0)
        self._throttled = throttled
        balance = r.get("balance")
        if balance:
            for rank in self.ranks:
                self.share.labels(str(rank), self.host).set(balance["shares"][rank])
                if _finite(balance["speed"][rank]):
                    self.speed.labels(str(rank), self.host).set(balance["speed"][rank])
        load = r.get("expert_load")
        for i, layer in enumerate(load["layers"] if load else ()):
            self.expert_imbalance.labels(str(layer)).set(load["imbalance"][i])
            self.expert_effective.labels(str(layer)).set(load["effective_experts"][i])
        if r.get("health"):
            self.skipped.set(r["health"]["skipped_steps"])
        active = {a["kind"] for a in r.get("alerts", [])}
        for kind in active | self._active_alerts:
            self.alert.labels(kind).set(1 if kind in active else 0)
        self._active_alerts = active

    def close(self) -> None:
        self.server.shutdown()
