"""GPU check of the clip folded into fused AdamW (duoka.train.optimizers.clip_to_norm) under
FSDP2: the folded path must step as an explicit clip followed by the same fused AdamW,
and differ from no clip at all. Run: torchrun --nproc-per-node=N bench/check_clip_fold.py
(CPU: add --cpu; the unit test test_optim.py covers one process)."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from duoka.train.optimizers import clip_to_norm


def run(mode: str, device: torch.device, mesh) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, fused=True)
    params = list(model.parameters())
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    for step in range(5):
        x = torch.randn(64, 256, device=device, generator=gen)
        (model(x).square().sum() * 10 * (step + 1)).backward()  # norms far above 1: the clip acts
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True).full_tensor()
        if mode == "folded":
            clip_to_norm(opt, params, norm, 1.0)
        elif mode == "explicit":
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm, foreach=True)
        opt.step()
        opt.zero_grad()
    return torch.cat([p.full_tensor().flatten() for p in params])


def main() -> None:
    cpu = "--cpu" in sys.argv
    dist.init_process_group("gloo" if cpu else "nccl")
    device = torch.device("cpu") if cpu else torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    if not cpu:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    folded, explicit, unclipped = (run(m, device, mesh) for m in ("folded", "explicit", "none"))
    same = (folded - explicit).abs().max().item()
    apart = (explicit - unclipped).abs().max().item()
    if dist.get_rank() == 0:
        ok = same <= 1e-6 and apart > 1e-4
        print(f"clip fold on {dist.get_world_size()} x {device.type}: |folded - explicit| max {same:.2e}, "
              f"|explicit - unclipped| max {apart:.2e}: {'OK' if ok else 'FAILED'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
