"""Alerts with advice: each one line naming the cause and the fix, raised from one step's
metrics record (with its per-rank and per-GPU readings). The trainer logs an alert when it
starts (not every step it lasts); every sink gets the active list."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Alert:
    kind: str  # imbalance | throttling | memory | data_wait | low_mfu | nonfinite | loss_spike | straggler
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


# What a well-tuned run reaches on H100/H200-class GPUs (bench/results/speed.md: 0.5B 41%,
# 1.5B 51%, 7B 51-54% MFU with compile); an alert fires below half of it.
def expected_mfu(n_params: float) -> float:
    if n_params < 1e9:
        return 0.35
    if n_params < 3e9:
        return 0.45
    return 0.50


def check(record: dict, n_params: float, *, imbalance=0.15, memory=0.90, data_wait=0.05) -> list[Alert]:
    out: list[Alert] = []
    step_time = record.get("step_time_s") or 0.0

    # Ranks of a synchronous job wait for the slowest: compare their own work, the timed
    # compute (balance on) or else the GPUs' utilisation.
    balance = record.get("balance")
    if balance and all(t for t in balance.get("compute_s", [])) and len(balance["compute_s"]) > 1:
        times = balance["compute_s"]
        slow = max(range(len(times)), key=times.__getitem__)
        spread = (max(times) - min(times)) / statistics.median(times)
        if spread > imbalance and balance.get("mode") != "auto":
            out.append(Alert("imbalance", f"rank {slow} computes {spread:.0%} longer per step than the fastest rank; "
                                          "the others wait for it: turn on --parallel.balance=auto"))
    gpus = record.get("gpus", [])
    utils = [g["utilization_pct"] for g in gpus if g.get("utilization_pct") is not None]
    if len(utils) > 1 and max(utils) - min(utils) > 100 * imbalance and not balance:
        low = min(gpus, key=lambda g: g.get("utilization_pct") or 0)
        out.append(Alert("imbalance", f"GPU {low['index']} (rank {low['rank']}) is {low['utilization_pct']}% busy "
                                      f"while another is {max(utils)}%: the ranks wait for each other; check for a "
                                      "slower or shared GPU (duoka monitor --gpus) or use --parallel.balance=auto"))
    for g in gpus:
        if g.get("throttled"):
            out.append(Alert("throttling", f"GPU {g['index']} (rank {g['rank']}) is slowed by "
                                           f"{', '.join(g['throttled'])} at {g.get('temperature_c')} C, "
                                           f"{g.get('power_w') or 0:.0f} W: check cooling and power limits "
                                           "(nvidia-smi -q -d PERFORMANCE)"))
        used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
        if used and total and used / total > memory:
            out.append(Alert("memory", f"GPU {g['index']} (rank {g['rank']}) memory {used / total:.0%} full: close to "
                                       "out of memory; lower training.micro_batch_size or turn on "
                                       "training.activation_checkpointing / training.fused_loss (duoka plan)"))
    if step_time and (record.get("data_time_s") or 0.0) > data_wait * step_time:
        out.append(Alert("data_wait", f"the step waited {record['data_time_s'] / step_time:.0%} of its time for data: "
                                      "prepare the corpus once with `duoka prepare` (memory-mapped shards) or put it "
                                      "on a faster disk"))
    mfu = record.get("mfu")
    if mfu is not None and mfu < 0.5 * expected_mfu(n_params):
        out.append(Alert("low_mfu", f"MFU {mfu:.0%} is under half of the ~{expected_mfu(n_params):.0%} this model "
                                    "reaches on these GPUs: keep training.compile on (its default on GPUs), use a "
                                    "larger micro-batch, and see the step breakdown in metrics.jsonl (phase_s) for "
                                    "what dominates"))
    return out


def health_alerts(record: dict) -> list[Alert]:
    """From the step's `health` (duoka.train.health): a non-finite step and a loss spike.
    Unlike the others these matter from the first step: no warm-up holds them back."""
    health = record.get("health")
    if not health:
        return []
    out: list[Alert] = []
    step, skipped = record["step"], health["skipped"]
    if health["nonfinite_in_row"]:
        out.append(Alert("nonfinite", f"step {step}: loss {record['loss']:.4g}, gradient norm "
                                      f"{record['grad_norm']:.4g}: NaN or infinite"
                                      + (", the update was skipped" if skipped else "")
                                      + f" ({health['nonfinite_in_row']} in a row; the job stops after "
                                        "reliability.max_nonfinite_steps): lower optimizer.lr, lengthen "
                                        "optimizer.warmup_steps or set training.grad_clip"))
    if health["spike"]:
        out.append(Alert("loss_spike", f"step {step}: loss {record['loss']:.4f} lies {health['loss_zscore']:.1f} "
                                       "standard deviations above the mean of the steps before"
                                       + (", the update was skipped" if skipped else "")
                                       + ": if spikes recur, lower optimizer.lr or look at the data of these steps"))
    return out
