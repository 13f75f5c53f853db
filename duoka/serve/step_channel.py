"""Tensor-parallel serving's control path: rank 0 runs the scheduler and, every step, sends
the step's model inputs (StepInputs) to the other ranks, which run the same forward (their
all-reduces meet rank 0's inside it) and wait for the next step.

One step is two broadcasts over the group: a fixed-size int64 header (the command and every
size and scalar of the step), then one int32 tensor holding the step's arrays back to back,
whose length the header gives. On a gloo group the tensors stay on the host, so the other
ranks get host StepInputs exactly like rank 0's prepare_inputs. That is the channel for GPUs
too (step_group makes it; nano-vllm and vLLM also send steps through the host): over NCCL,
rank 0 would first copy the step to its GPU, a copy from pageable memory that waits for the
work already queued there, and the others would get device tensors. Sampling runs on rank 0
only, so nothing of it travels.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

from duoka.serve.runner import NUM_SIZES, SCALARS, StepInputs, array_shapes

STEP, SHUTDOWN = 1, 2  # header[0]
# header: command, T, B, max_blocks, S, A (StepInputs.sizes), then StepInputs' SCALARS; the rest is spare room, so a new
# scalar does not change the message's size.
HEADER_LEN = 16
# A server may sit idle for weeks; its other ranks wait for the next step all that time.
IDLE_TIMEOUT = timedelta(days=365)


def _transport(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL moves device tensors only; gloo moves host tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def step_group(model_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The group the steps travel on: a gloo group over the ranks of the model's tp group (on
    GPUs too, so that the steps travel as host tensors), of its own because the other ranks
    wait on it for as long as the server is idle: its timeout is IDLE_TIMEOUT, not the model
    group's, which keeps catching a stuck collective. Every rank calls it, at the same point."""
    group = model_group or dist.group.WORLD
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", timeout=IDLE_TIMEOUT)


def broadcast_step(inputs: StepInputs | None, group: dist.ProcessGroup | None) -> None:
    """Rank 0 of the group: send one step's inputs to the other ranks (None: tell them to stop)."""
    device = _transport(group)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if inputs is None:
        header[0] = SHUTDOWN
        dist.broadcast(header.to(device), group=group, group_src=0)
        return
    values = [STEP, *inputs.sizes(), *inputs.scalars().values()]
    header[:len(values)] = torch.tensor(values)
    dist.broadcast(header.to(device), group=group, group_src=0)
    dist.broadcast(inputs.packed().to(device), group=group, group_src=0)


def receive_step(group: dist.ProcessGroup | None) -> StepInputs | None:
    """The other ranks: the next step's inputs from rank 0 of the group, or None when it stops."""
    device = _transport(group)
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, group=group, group_src=0)
    command, *sizes = header[:1 + NUM_SIZES].tolist()
    scalars = dict(zip(SCALARS, header[1 + NUM_SIZES:1 + NUM_SIZES + len(SCALARS)].tolist()))
    if command == SHUTDOWN:
        return None
    if command != STEP:
        raise RuntimeError(f"tp worker received unknown command {command} from rank 0")
    payload = torch.empty(sum(math.prod(shape) for shape in array_shapes(*sizes)), dtype=torch.int32, device=device)
    dist.broadcast(payload, group=group, group_src=0)
    return StepInputs.unpack(payload, tuple(sizes), scalars)


def worker_loop(runner, group: dist.ProcessGroup | None) -> None:
    """A tp rank other than 0: run every step rank 0 sends, until it says stop.
    runner.execute(inputs) runs the forward (its all-reduces pair with rank 0's)."""
    while (inputs := receive_step(group)) is not None:
        runner.execute(inputs)
