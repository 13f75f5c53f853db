"""The parallel layout: sizes of each parallel dimension and the one named DeviceMesh.

Dimension names follow torchtitan: dp_replicate x dp_shard x tp x pp. Only data
parallelism exists so far; tensor and pipeline parallelism extend this same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from duoka.config import ParallelConfig
from duoka.errors import DuokaError


@dataclass(frozen=True)
class ParallelDims:
    dp_mode: str
    dp_replicate: int
    dp_shard: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        rep, shard = cfg.dp_replicate, cfg.dp_shard
        if cfg.dp_mode == "ddp":
            if shard not in (-1, 1):
                raise DuokaError(f"parallel.dp_shard={shard} needs parallel.dp_mode=fsdp (ddp does not shard)",
                                 "set parallel.dp_mode=fsdp, or leave dp_shard at -1")
            shard = 1
            rep = world_size if rep == -1 else rep
        else:
            rep = 1 if rep == -1 else rep
            if shard == -1:
                if world_size % rep:
                    raise DuokaError(f"parallel.dp_replicate={rep} does not divide the world size {world_size}",
                                     f"choose dp_replicate from {_divisors(world_size)}")
                shard = world_size // rep
        if rep < 1 or shard < 1:
            raise DuokaError(f"parallel.dp_replicate={rep} and dp_shard={shard} must be >= 1 (or -1 for auto)")
        if rep * shard != world_size:
            raise DuokaError(
                f"parallel.dp_replicate x dp_shard = {rep} x {shard} = {rep * shard}, but {world_size} processes run",
                f"make the product {world_size} (e.g. dp_replicate={rep} and dp_shard={world_size // rep}) "
                "or change --nproc-per-node / --nnodes" if world_size % rep == 0 else
                f"make the product {world_size}, or change --nproc-per-node / --nnodes",
            )
        return cls(cfg.dp_mode, rep, shard, world_size)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_mode == "fsdp"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        if not self.fsdp:
            return init_device_mesh(device_type, (self.dp_replicate,), mesh_dim_names=("dp_replicate",))
        if self.dp_replicate == 1:
            return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        # HSDP: shards within each replica group, gradients all-reduced across groups.
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))

    def describe(self) -> str:
        if not self.fsdp:
            return f"DDP x{self.dp_replicate}"
        if self.dp_replicate == 1:
            return f"FSDP2 x{self.dp_shard}"
        return f"HSDP {self.dp_replicate} replicas x {self.dp_shard} shards"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
