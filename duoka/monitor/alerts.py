"""Alerts with advice: each one line naming the cause and the fix, raised from one step's
metrics record (with its per-rank and per-GPU readings). The trainer logs an alert when it
starts (not every step it lasts); every sink gets the active list."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Alert:
    kind: str  # imbalance | throttling | memory | data_wait | low_mfu | nonfinite | loss_spike | straggler
    #   | expert_collapse
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


# Routing collapse (E experts per layer, k per token; effective experts lie between k and E).
# Below max(2k, E/4) effective experts the router sends the tokens to a small pool as if the
# rest did not exist (2k: twice the experts each token must pick; E/4: three quarters idle).
def collapse_floor(num_experts: int, experts_per_tok: int) -> float:
    return max(2.0 * experts_per_tok, num_experts / 4)


# An expert picked by 3 tokens in 4 (share 0.75/k, imbalance 0.75 E/k) is a hot spot whose
# work every step waits for.
HOT_SHARE = 0.75
# A few skewed batches (the first steps, a change of data) are no collapse: it must last.
COLLAPSE_STEPS = 20


class ExpertCollapse:
    """Alerts (expert_collapse) when a MoE layer's routing stays collapsed for `steps`
    consecutive steps: its effective experts under collapse_floor, or an expert taking
    HOT_SHARE of the tokens. Keeps a count per layer across steps, so one per run."""

    def __init__(self, num_experts: int, experts_per_tok: int, aux_loss_coef: float, aux_loss_on: bool,
                 steps: int = COLLAPSE_STEPS):
        self.floor = collapse_floor(num_experts, experts_per_tok)
        self.hot = HOT_SHARE * num_experts / experts_per_tok
        self.num_experts, self.aux_loss_coef, self.aux_loss_on, self.steps = (
            num_experts, aux_loss_coef, aux_loss_on, steps)
        self.in_row: dict[int, int] = {}

    def check(self, record: dict) -> list[Alert]:
        load = record.get("expert_load")
        if not load:
            return []
        for layer, imbalance, effective in zip(load["layers"], load["imbalance"], load["effective_experts"]):
            bad = effective < self.floor or imbalance >= self.hot
            self.in_row[layer] = self.in_row.get(layer, 0) + 1 if bad else 0
        collapsed = [i for i, layer in enumerate(load["layers"]) if self.in_row[layer] >= self.steps]
        if not collapsed:
            return []
        worst = min(collapsed, key=lambda i: load["effective_experts"][i])
        layers = [load["layers"][i] for i in collapsed]
        aux = (f"raise router_aux_loss_coef (now {self.aux_loss_coef:g}; 0.001 to 0.01 is usual)"
               if self.aux_loss_on else "set output_router_logits=true (now false: no load-balancing loss is "
                                        "trained) with router_aux_loss_coef about 0.001")
        return [Alert("expert_collapse",
                      f"MoE layer(s) {layers}: routing collapsed for {self.steps}+ steps (layer "
                      f"{load['layers'][worst]}: {load['effective_experts'][worst]:.1f} effective experts of "
                      f"{self.num_experts}, busiest expert at {load['imbalance'][worst]:.1f}x an even share): {aux} "
                      "in the model's config.json (model.path), or lower optimizer.lr")]
