"""Training health as one component of the trainer: non-finite steps and loss spikes.

A step whose gradient norm is NaN or infinite has its update skipped, and so, under
reliability.skip_spikes, has a step whose loss is a spike. The decision is made on the device
before the optimizer step, from values every rank holds alike (the global gradient norm; the
all-reduced loss), so every rank skips the same steps and the host never waits for the GPU. A
non-finite loss makes the norm non-finite too: its backward carries the NaN into every gradient,
and the reduction of the gradients into every rank's.

Counting, alerts and the stop after reliability.max_nonfinite_steps in a row are decided at the
step's (deferred) end from the gathered record, the same on every rank, so all stop at the same
step. A skipped step still consumes its data and advances the LR schedule (both are functions of
the step); the optimizer's own step count does not advance. No checkpoint is written from weights
that hold a NaN or infinity, and each checkpoint says whether the run was healthy when it was
written (train_state.json `healthy`), so that retention keeps the newest healthy one.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from duoka import runtime
from duoka.config import ReliabilityConfig
from duoka.errors import DuokaError
from duoka.parallel.dtensor import local_value
from duoka.train.checkpoint_io import checkpoint_step, complete_checkpoints, is_healthy
from duoka.train.step_end import to_host

# The smallest standard deviation a spike is measured against, in nats: a flat stretch of loss
# (a stuck run, or the repeated losses of a test) would otherwise make every tiny rise a spike.
SPIKE_MIN_STD = 1e-3


class Health:
    """`allow_update` before each optimizer step, `end_step` with each step's record,
    `raise_if_failing` after it is published; `check_weights` and `healthy` for saves."""

    def __init__(self, cfg: ReliabilityConfig, inject_nan_step: int, model: torch.nn.Module, run_dir: Path,
                 device: torch.device, counted: bool, start_step: int, inject_nan_count: int = 1):
        self.max_in_row, self.run_dir, self.device, self.counted = cfg.max_nonfinite_steps, run_dir, device, counted
        self.zscore, self.window, self.skip_spikes = cfg.spike_zscore, cfg.spike_window, cfg.skip_spikes
        self.history: list[tuple[int, float]] = []  # (step, loss) of the latest steps with a finite loss
        self.in_row = 0  # non-finite steps in a row, up to the last ended step
        self.skipped = 0  # updates skipped in the whole run
        self.ended = start_step  # the last step (1-based) whose end was seen
        # The first step of the latest stretch of troubled steps (non-finite or a loss spike): a
        # checkpoint whose next step was already in it is no place to resume from.
        self.trouble_start: int | None = None
        self.last_troubled = -1  # the last troubled step
        self._launched = start_step  # steps whose update was decided: the next forward is step _launched + 1
        self._pending: dict[int, tuple] = {}  # step -> (skip flag in host memory, spike statistics or None)
        self.inject_nan_steps = range(inject_nan_step, inject_nan_step + inject_nan_count if inject_nan_step else 0)
        if inject_nan_step:
            # debug.inject_nan_step (and _count): the final norm's output is NaN for those steps, on every rank,
            # so its loss and (through the backward) every gradient are NaN, as in a real blow-up.
            for name, module in model.named_modules():
                if name.split(".")[-1] == "norm":
                    module.register_forward_hook(self._inject_nan)

    def _inject_nan(self, module, inputs, output):
        return output * math.nan if self._launched + 1 in self.inject_nan_steps else output

    # ------------------------------------------------------------------ before the optimizer step

    def _spike_statistics(self, step: int) -> tuple[float, float] | None:
        """Mean and standard deviation of the loss over the spike_window steps before step - 1
        (1-based): when a step is launched, the previous one's figures are not read yet (its
        end is deferred), so the window ends one step earlier, the same way in every run."""
        if not self.zscore:
            return None
        losses = [loss for s, loss in self.history if s <= step - 2][-self.window:]
        if len(losses) < self.window:
            return None
        return statistics.fmean(losses), max(statistics.pstdev(losses), SPIKE_MIN_STD)

    def allow_update(self, step: int, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
                     loss_sum: torch.Tensor, global_tokens: torch.Tensor) -> bool:
        """Whether the caller runs optimizer.step() for step `step` (0-based). A fused optimizer
        is told to skip on the device (found_inf) and always runs; the others (foreach AdamW on
        CPU, and the optimizers without a fused step: duoka.train.optimizers) read the flag here,
        which on a GPU waits once per step for backward to finish."""
        n = step + 1
        stats = self._spike_statistics(n)
        skip = ~torch.isfinite(grad_norm)
        if self.skip_spikes and stats is not None:  # stats are the same on every rank: so is this collective
            loss = loss_sum.double() if self.counted else torch.zeros((), dtype=torch.float64, device=self.device)
            dist.all_reduce(loss)
            mean = loss / global_tokens
            skip = skip | ~torch.isfinite(mean) | (mean > stats[0] + self.zscore * stats[1])
        self._launched = n
        if optimizer.defaults.get("fused"):
            runtime.set_found_inf(optimizer, skip.to(torch.float32))
            self._pending[n] = (to_host(skip), stats)
            return True
        skip = bool(skip)
        self._pending[n] = (skip, stats)
        return not skip

    # ------------------------------------------------------------------ at the step's end

    def end_step(self, record: dict) -> None:
        """Count the step and put its health into the record (`health`; the alerts read it)."""
        n, loss, norm = record["step"], record["loss"], record["grad_norm"]
        flag, stats = self._pending.pop(n)
        skipped = bool(flag)
        finite = math.isfinite(loss) and math.isfinite(norm)
        self.in_row = 0 if finite else self.in_row + 1
        self.skipped += skipped
        self.ended = n
        zscore = (loss - stats[0]) / stats[1] if stats is not None and math.isfinite(loss) else None
        spike = zscore is not None and zscore > self.zscore
        if not finite or spike:
            if self.trouble_start is None or self.last_troubled != n - 1:
                self.trouble_start = n
            self.last_troubled = n
        if math.isfinite(loss):
            # A spike stays in the window: a lasting rise of the loss then stops counting as one
            # after a few steps instead of being skipped for ever.
            self.history = (self.history + [(n, loss)])[-(self.window + 1):]
        record["health"] = {"skipped": skipped, "nonfinite_in_row": self.in_row, "skipped_steps": self.skipped,
                            "loss_zscore": zscore, "spike": spike}

    def raise_if_failing(self) -> None:
        """After max_nonfinite_steps non-finite steps in a row: stop, naming the last good checkpoint."""
        if self.in_row < self.max_in_row:
            return
        first = self.ended - self.in_row + 1
        cause = (f"the loss or gradient norm was NaN or infinite at {self.in_row} steps in a row (steps {first} to "
                 f"{self.ended}, reliability.max_nonfinite_steps={self.max_in_row}); their updates were skipped")
        raise DuokaError(cause, self._resume_advice())

    def _resume_advice(self) -> str:
        good = self.last_good_checkpoint()
        change = ("with a lower optimizer.lr, a longer optimizer.warmup_steps or training.grad_clip > 0 "
                  "(or raise reliability.max_nonfinite_steps to ride out a short stretch)")
        if good is None:
            return f"no healthy checkpoint was written: start again {change}"
        return f"resume from the last good checkpoint {good} {change}: --checkpoint.resume={good}"

    def last_good_checkpoint(self) -> Path | None:
        """The newest complete checkpoint written while the run was healthy and followed by at
        least one normal step: one saved just before the trouble began would diverge again."""
        before = self.trouble_start - 1 if self.trouble_start is not None else None
        for path in reversed(complete_checkpoints(self.run_dir)):
            if is_healthy(path) and (before is None or checkpoint_step(path) < before):
                return path
        return None

    # ------------------------------------------------------------------ checkpoints

    @property
    def healthy(self) -> bool:
        """The last ended step's loss and gradient norm were finite."""
        return self.in_row == 0

    def check_weights(self, params: list[torch.nn.Parameter], step: int) -> None:
        """Refuse to save (or export) weights holding a NaN or infinity. Each rank looks at
        its own shards; the verdict is reduced, so every rank raises or none. A collective:
        called at a save, which every rank reaches at the same step."""
        local = [t for t in (local_value(p.detach()) for p in params) if t.numel()]  # an FSDP2 shard may be empty
        largest = torch.nn.utils.get_total_norm(local, norm_type=math.inf, foreach=True)  # no overflow, unlike L2
        finite = torch.isfinite(largest).to(self.device, torch.float32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise DuokaError(f"the weights hold NaN or infinite values after step {step}: no checkpoint or export "
                             "was written from them", self._resume_advice())

    def state_dict(self) -> dict:
        return {"history": self.history, "nonfinite_in_row": self.in_row, "skipped_steps": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.history = [(int(s), float(loss)) for s, loss in state["history"]]
        self.in_row, self.skipped = state["nonfinite_in_row"], state["skipped_steps"]
