"""The parallel layout: sizes of each parallel dimension and the one named DeviceMesh.

Dimension names and order follow torchtitan: pp x dp_replicate x dp_shard x tp, tp
innermost so that a tensor-parallel group is made of neighbouring ranks (one NVLink
domain), pp outermost (its point-to-point traffic is the lightest, it may cross nodes).

Data parallelism under model parallelism (tp or pp > 1) always runs through FSDP2:
dp_mode=fsdp shards over dp_shard as usual; dp_mode=ddp keeps replicated weights as an
FSDP2 mesh with a shard dimension of size 1 (the same semantics as DDP: every replica
holds everything, gradients are all-reduced), because DDP does not accept DTensor
parameters and pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from duoka.config import ParallelConfig
from duoka.errors import DuokaError
from duoka.models.qwen2.context_parallel import resolve_context_method

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
CONTEXT_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_cp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_mode: str
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert parallelism: dp_shard splits into dp_shard // ep groups (outer) of ep ranks (inner,
    neighbours); expert_mesh() names the two."""
    cp: int = 1
    """Context parallelism: dp_shard splits into dp_shard // cp groups of cp neighbouring ranks
    that share one batch and split its sequences; context_mesh() names the two."""
    cp_method: str = "auto"
    """parallel.cp_method as configured; context_method(n_heads) resolves it for a model."""

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        tp, pp = cfg.tp, cfg.pp
        if world_size % (tp * pp):
            raise DuokaError(f"parallel.tp x parallel.pp = {tp} x {pp} = {tp * pp} does not divide the "
                             f"{world_size} processes", f"choose tp x pp from {_divisors(world_size)} "
                             "(or change --nproc-per-node / --nnodes)")
        dp_world = world_size // (tp * pp)  # ranks left for data parallelism
        rep, shard = cfg.dp_replicate, cfg.dp_shard
        if cfg.dp_mode == "ddp":
            if shard not in (-1, 1):
                raise DuokaError(f"parallel.dp_shard={shard} needs parallel.dp_mode=fsdp (ddp does not shard)",
                                 "set parallel.dp_mode=fsdp, or leave dp_shard at -1")
            shard = 1
            rep = dp_world if rep == -1 else rep
        else:
            rep = 1 if rep == -1 else rep
            if shard == -1:
                if dp_world % rep:
                    raise DuokaError(f"parallel.dp_replicate={rep} does not divide the {dp_world} data-parallel "
                                     "ranks", f"choose dp_replicate from {_divisors(dp_world)}")
                shard = dp_world // rep
        if rep < 1 or shard < 1:
            raise DuokaError(f"parallel.dp_replicate={rep} and dp_shard={shard} must be >= 1 (or -1 for auto)")
        if rep * shard * tp * pp != world_size:
            raise DuokaError(
                f"parallel.dp_replicate x dp_shard x tp x pp = {rep} x {shard} x {tp} x {pp} = "
                f"{rep * shard * tp * pp}, but {world_size} processes run",
                f"make the product {world_size} (leave dp_replicate or dp_shard at -1 to fill it in), "
                "or change --nproc-per-node / --nnodes")
        if cfg.pp_schedule in ("interleaved_1f1b", "zero_bubble") and cfg.pp_stages_per_rank < 2 and pp > 1:
            raise DuokaError(f"parallel.pp_schedule={cfg.pp_schedule} interleaves several stages per rank, but "
                             "parallel.pp_stages_per_rank=1", "set parallel.pp_stages_per_rank=2 (or more), or use "
                             "pp_schedule=1f1b / gpipe")
        if cfg.pp_schedule in ("gpipe", "1f1b") and cfg.pp_stages_per_rank > 1 and pp > 1:
            raise DuokaError(f"parallel.pp_schedule={cfg.pp_schedule} runs one stage per rank, but "
                             f"parallel.pp_stages_per_rank={cfg.pp_stages_per_rank}",
                             "use pp_schedule=interleaved_1f1b or zero_bubble for several stages per rank, or set "
                             "pp_stages_per_rank=1")
        ep = cfg.ep
        if ep > 1 and (cfg.dp_mode != "fsdp" or shard % ep):
            raise DuokaError(f"parallel.ep={ep} splits the experts over dp_shard ranks, but dp_mode={cfg.dp_mode} "
                             f"with dp_shard={shard}",
                             f"set parallel.dp_mode=fsdp and choose ep from {_divisors(shard)} (dividing dp_shard)")
        cp = cfg.cp
        if cp > 1:
            _check_context_parallel(cfg, shard, tp, pp, ep)
        return cls(cfg.dp_mode, rep, shard, world_size, tp, pp, ep, cp, cfg.cp_method)

    def check_model(self, n_heads: int, n_kv_heads: int, n_layers: int, stages_per_rank: int = 1,
                    num_experts: int = 0) -> None:
        """Refuse a layout the model's shape cannot take, before any worker starts."""
        if self.ep > 1 and (not num_experts or num_experts % self.ep):
            fix = (f"use parallel.ep in {[d for d in _divisors(num_experts) if self.dp_shard % d == 0]}"
                   if num_experts else "set parallel.ep=1 (expert parallelism is for mixture-of-experts models)")
            raise DuokaError(f"parallel.ep={self.ep} does not divide the model's {num_experts} routed experts", fix)
        if self.tp > 1 and (n_heads % self.tp or n_kv_heads % self.tp):
            valid = [d for d in _divisors(n_kv_heads) if n_heads % d == 0]
            raise DuokaError(
                f"parallel.tp={self.tp} does not divide the model's {n_heads} attention heads and {n_kv_heads} "
                "KV heads (each tensor-parallel rank must own whole heads; KV heads are not replicated)",
                f"use parallel.tp in {valid}")
        if self.cp > 1:
            self.context_method(n_heads)  # refuses ulysses where the heads do not divide by cp
        stages = self.pp * stages_per_rank
        if self.pp > 1 and stages > n_layers:
            raise DuokaError(f"parallel.pp x pp_stages_per_rank = {stages} stages but the model has {n_layers} "
                             "layers", f"use at most {n_layers} stages")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: ranks with batches of their own (a cp group shares one)."""
        return self.dp_replicate * self.dp_shard // self.cp

    @property
    def fsdp_size(self) -> int:
        """Ranks the parameters are sharded or replicated over, whose gradients are averaged:
        every data-parallel rank and, under cp, each one's cp ranks too."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 applies data parallelism (and DDP does not)."""
        return self.dp_mode == "fsdp" or self.tp > 1 or self.pp > 1

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh over all four dimensions (size-1 ones included, so every lookup by
        name works whatever the layout)."""
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)

    def expert_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh the routed experts live on: dp_shard split into (dp_shard_mod_ep, ep), ep
        inner, so that rank r's ep group is the one its dp_shard coordinate s // ep names."""
        sizes = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
        return init_device_mesh(device_type, sizes, mesh_dim_names=EXPERT_MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position along each mesh dimension (row-major, tp fastest)."""
        out = {}
        for name, size in zip(reversed(MESH_DIMS), reversed((self.pp, self.dp_replicate, self.dp_shard, self.tp))):
            rank, out[name] = divmod(rank, size)
        return out

    def dp_rank(self, rank: int) -> int:
        """Which batch shard `rank` trains on (its cp group's, under cp)."""
        c = self.coordinates(rank)
        return (c["dp_replicate"] * self.dp_shard + c["dp_shard"]) // self.cp

    def cp_rank(self, rank: int) -> int:
        """`rank`'s place in its cp group (which chunks of the sequence it holds)."""
        return self.coordinates(rank)["dp_shard"] % self.cp

    def context_method(self, n_heads: int) -> str:
        """How a model of n_heads attention heads spans its split sequences: allgather or ulysses
        (auto resolved: ulysses where the heads divide by cp)."""
        return resolve_context_method(self.cp_method, self.cp, n_heads)

    def context_mesh(self, device_type: str) -> DeviceMesh:
        """dp_shard split into (dp_shard_mod_cp, cp), cp inner: a cp group is cp neighbours."""
        sizes = (self.pp, self.dp_replicate, self.dp_shard // self.cp, self.cp, self.tp)
        return init_device_mesh(device_type, sizes, mesh_dim_names=CONTEXT_MESH_DIMS)

    def describe(self) -> str:
        if not self.fsdp:
            dp = f"DDP x{self.dp_replicate}"
        elif self.dp_mode == "ddp":
            dp = f"replicated x{self.dp_replicate}"
        elif self.dp_replicate == 1:
            dp = f"FSDP2 x{self.dp_shard}"
        else:
            dp = f"HSDP {self.dp_replicate} replicas x {self.dp_shard} shards"
        parts = [dp] if self.dp_size > 1 or not self.model_parallel else []
        parts += ([f"TP x{self.tp}"] if self.tp > 1 else []) + ([f"PP x{self.pp}"] if self.pp > 1 else [])
        parts += [f"EP x{self.ep}"] if self.ep > 1 else []
        parts += [f"CP x{self.cp}"] if self.cp > 1 else []
        return " | ".join(parts)


def _check_context_parallel(cfg: ParallelConfig, shard: int, tp: int, pp: int, ep: int) -> None:
    cp = cfg.cp
    if cfg.dp_mode != "fsdp" or shard % cp:
        raise DuokaError(f"parallel.cp={cp} splits each sequence over dp_shard ranks, but dp_mode={cfg.dp_mode} "
                         f"with dp_shard={shard}",
                         f"set parallel.dp_mode=fsdp and choose cp from {_divisors(shard)} (dividing dp_shard)")
    others = [(tp > 1, f"parallel.tp={tp}"), (pp > 1, f"parallel.pp={pp}"), (ep > 1, f"parallel.ep={ep}"),
              (cfg.balance != "off", f"parallel.balance={cfg.balance}")]
    for refused, what in others:
        if refused:
            raise DuokaError(f"parallel.cp={cp} does not combine with {what} yet",
                             f"use parallel.cp=1, or {what.split('=')[0]} at its default")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
