"""Expert parallelism (parallel.ep) for the MoE layers of a training model: each rank of an
ep group holds num_experts / ep of every MoE layer's routed experts, and the tokens routed
to an expert travel to its rank and back by all-to-all (GShard, arXiv:2006.16668;
torchtitan's ExpertParallel).

The routed experts (duoka.models.qwen2.moe.GroupedExperts) take their rows grouped by
global expert with the group sizes; the dispatch wraps exactly that call with a forward
pre-hook and a forward hook, so the model's code and its parameter names do not change:

    before: the sizes of every (source rank, local expert) group by one all-to-all of the
            counts; the rows by one all-to-all of uneven splits (rows for the experts of
            rank j are contiguous, since the experts are grouped in order); then regrouped
            from (source rank, local expert) order to (local expert, source rank) order
    inside: the local experts on their rows (their weights are the local shards)
    after:  the rows put back in (source rank, local expert) order and returned by the
            reverse all-to-all, in the order the caller sent them

Both all-to-alls are differentiable (functional collectives): backward sends each row's
gradient back the way the row came. Each rank computes the same products for an expert as
one process would, so the layout equals one process up to the order gradients are summed.

Expert weights are DTensors sharded on dim 0 over the ep mesh; FSDP2 then shards them over
the dp_shard // ep ranks holding the same experts (on dim 1, so the two shardings never
stack on one dimension) and divides their reduced gradients by the whole data-parallel size
(set_gradient_divide_factor), as the other parameters' are: each rank's loss is scaled for
a mean over every data-parallel rank, and an expert's gradient already sums its ep group's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from duoka.models.qwen2.moe import GroupedExperts


def regroup_order(sizes: torch.Tensor) -> torch.Tensor:
    """For rows laid out in groups sizes[s, e] in row-major (s, e) order, the row indices that
    list them in (e, s) order instead. sizes: [S, E] int."""
    flat = sizes.flatten().long()
    starts = torch.cumsum(flat, 0) - flat  # where each (s, e) group starts
    by_e = sizes.t().flatten().long()  # group sizes in (e, s) order
    starts_by_e = starts.view(sizes.shape).t().flatten()
    first = torch.repeat_interleave(starts_by_e, by_e)
    offset_in_group = torch.arange(int(by_e.sum()), device=sizes.device) - torch.repeat_interleave(
        torch.cumsum(by_e, 0) - by_e, by_e)
    return first + offset_in_group


class TokenDispatch:
    """The all-to-all around one GroupedExperts call, as its pre-hook and hook. The state of
    the call in flight (splits and the regrouping) lives between the two hooks; an
    activation-checkpoint recompute runs both again, in order."""

    def __init__(self, group: dist.ProcessGroup, ep: int, num_experts: int):
        self.group, self.ep, self.local = group, ep, num_experts // ep
        self._state: tuple[list[int], list[int], torch.Tensor] | None = None

    def before(self, module: nn.Module, args: tuple) -> tuple:
        x, counts = args
        ep, local = self.ep, self.local
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ep sources x local experts]
        sizes = recv_counts.view(ep, local)
        # One host synchronisation: the all-to-all needs its split sizes on the host.
        send = counts.view(ep, local).sum(1).tolist()
        recv = sizes.sum(1).tolist()
        rows = all_to_all_single_autograd(x, recv, send, self.group)
        order = regroup_order(sizes)
        self._state = (send, recv, order)
        return rows[order], sizes.sum(0)

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        send, recv, order = self._state
        self._state = None
        back = output.new_empty(output.shape).index_copy(0, order, output)  # (source, expert) order again
        return all_to_all_single_autograd(back, send, recv, self.group)


def shard_experts(experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """The stacked expert weights as DTensors sharded on the expert dimension over ep_mesh
    (on the meta device, before FSDP2 and before any memory is taken)."""
    for name, param in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[GroupedExperts]:
    """Shards every MoE layer's routed experts over ep_mesh and hooks the token dispatch
    around each; returns the expert modules (FSDP2 shards them on their own mesh)."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    found = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for experts in found:
        dispatch = TokenDispatch(group, ep, experts.w1.shape[0])
        shard_experts(experts, ep_mesh)
        experts.register_forward_pre_hook(dispatch.before)
        experts.register_forward_hook(dispatch.after)
    return found

