"""Apply the parallel layout to a meta-built Qwen2, in torchtitan's order:
tensor parallel plan (with the model-parallel issue) -> activation checkpointing ->
compile -> FSDP2 (per block, then the root) or DDP.

The model itself stays a plain module; everything distributed happens here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from duoka.config import Config
from duoka.models.qwen2.model import Qwen2
from duoka.parallel.dims import ParallelDims


def parallelize_qwen2(model: Qwen2, dims: ParallelDims, mesh: DeviceMesh, cfg: Config, compute_dtype: torch.dtype):
    """Returns the module to train (the model itself, sharded in place, or a DDP wrapper).

    Called on the meta device for FSDP (sharding happens before any memory is taken);
    DDP needs real storage, so the caller materialises first for ddp."""
    if cfg.training.activation_checkpointing == "full":
        for name, block in model.layers.items():
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)  # in place: parameter names stay the same

    if dims.fsdp:
        # bf16 parameters for compute, fp32 gradient reduction, fp32 master weights in the
        # optimizer: the usual mixed precision recipe.
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        reshard = cfg.parallel.reshard_after_forward
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        # The root holds the embedding, final norm and head; it is used last in forward and
        # first in backward, so keeping it gathered after forward saves one all-gather.
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        return model
    if dims.world_size == 1:
        return model
    device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.get_group())


def unwrap(module: nn.Module) -> Qwen2:
    return module.module if isinstance(module, DistributedDataParallel) else module
