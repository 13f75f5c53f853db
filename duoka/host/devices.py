"""Which GPUs a job uses: `--gpus 0,3`, `--gpus auto:N`, or what CUDA_VISIBLE_DEVICES says.

Indices are the ones nvidia-smi prints: the launcher sets CUDA_DEVICE_ORDER=PCI_BUS_ID,
because CUDA's default order (fastest first) can differ from nvidia-smi's and then
"GPU 1" in one tool is another card in the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from duoka.errors import DuokaError


@dataclass(frozen=True)
class GpuReading:
    index: int  # nvidia-smi index (PCI bus order)
    uuid: str
    name: str
    memory_used_mib: int
    memory_total_mib: int
    utilization_pct: int


_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                "fp16": "float16", "float16": "float16"}


def compute_dtype_name(choice: str, device_type: str) -> str:
    """The torch dtype name for a dtype setting (training.dtype, `generate --dtype`); the one
    "auto" rule: bfloat16 on GPU, float32 on CPU."""
    if choice == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    try:
        return _DTYPE_NAMES[choice]
    except KeyError:
        raise ValueError(f"unknown dtype {choice!r}; expected auto or one of {', '.join(_DTYPE_NAMES)}") from None


NVML_FIX = ("check the driver with `nvidia-smi`; a driver/library version mismatch needs a reboot or a reload of "
            "the nvidia kernel module")


def check_torch_sees_no_gpu(why_no_nvml: str, fix: str) -> None:
    """Raise when PyTorch sees GPUs that NVML could not list (see read_gpus)."""
    import torch

    if torch.cuda.is_available():
        raise DuokaError(f"PyTorch sees GPUs but {why_no_nvml}", fix)


def read_gpus(check_torch: bool = True) -> list[GpuReading]:
    """All GPUs of this machine through NVML (which ignores CUDA_VISIBLE_DEVICES); an empty
    list on a machine without an NVIDIA driver. Where PyTorch sees GPUs but NVML cannot be
    read, that is an error, never a silent switch to CPU training. `check_torch=False`
    leaves that check to the caller (check_torch_sees_no_gpu): importing torch takes ~2 s,
    which the launcher spends after starting its worker server, not before."""
    try:
        import pynvml
    except ImportError:
        if check_torch:
            check_torch_sees_no_gpu("nvidia-ml-py (NVML) is not installed", "pip install nvidia-ml-py")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if check_torch:
            check_torch_sees_no_gpu(f"NVML cannot be read ({e})", NVML_FIX)
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append(GpuReading(i, uuid if isinstance(uuid, str) else uuid.decode(),
                                  name if isinstance(name, str) else name.decode(),
                                  mem.used // 2**20, mem.total // 2**20, util.gpu))
        return out
    finally:
        pynvml.nvmlShutdown()


def visible_indices(env_value: str | None, gpus: list[GpuReading]) -> list[int]:
    """nvidia-smi indices that CUDA_VISIBLE_DEVICES leaves visible (indices or GPU- UUIDs)."""
    if env_value is None:
        return [g.index for g in gpus]
    out = []
    for item in (x.strip() for x in env_value.split(",")):
        if not item:
            continue
        if item.isdigit():
            out.append(int(item))
        else:
            match = [g.index for g in gpus if g.uuid.startswith(item)]
            if not match:
                raise DuokaError(f"CUDA_VISIBLE_DEVICES names {item!r}, which is no GPU of this machine",
                                 "use indices or UUIDs from `nvidia-smi -L`")
            out.append(match[0])
    return out


def select_gpus(spec: str | None, env_value: str | None, gpus: list[GpuReading]) -> list[int]:
    """The nvidia-smi indices to use, honouring an existing CUDA_VISIBLE_DEVICES: --gpus may
    only pick among the GPUs it leaves visible."""
    visible = visible_indices(env_value, gpus)
    if spec is None:
        return visible
    if not gpus:
        raise DuokaError(f"--gpus {spec} was given but no GPU is visible (NVML found none)",
                         "drop --gpus to train on CPU processes, or check the driver with `nvidia-smi`")
    if spec.startswith("auto:"):
        try:
            n = int(spec[5:])
        except ValueError:
            raise DuokaError(f"--gpus {spec}: N in auto:N must be a number", "write e.g. --gpus auto:2") from None
        candidates = [g for g in gpus if g.index in visible]
        if not 1 <= n <= len(candidates):
            raise DuokaError(f"--gpus {spec} asks for {n} GPUs but {len(candidates)} are visible",
                             f"use auto:1 to auto:{len(candidates)}")
        # Least busy first: utilisation, then memory in use (another job's allocation).
        ranked = sorted(candidates, key=lambda g: (g.utilization_pct, g.memory_used_mib, g.index))
        return sorted(g.index for g in ranked[:n])
    try:
        wanted = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise DuokaError(f"--gpus {spec} is not a list of GPU indices", "write e.g. --gpus 0,3 or --gpus auto:2") from None
    if len(set(wanted)) != len(wanted):
        raise DuokaError(f"--gpus {spec} names a GPU twice", "list each GPU once")
    outside = [i for i in wanted if i not in visible]
    if outside:
        where = f"CUDA_VISIBLE_DEVICES={env_value}" if env_value is not None else "this machine"
        raise DuokaError(f"--gpus {spec}: GPU {outside[0]} is not among the GPUs {where} offers ({visible})",
                         "pick from those, or unset CUDA_VISIBLE_DEVICES (indices are nvidia-smi's)")
    return wanted


def device_env(indices: list[int]) -> dict[str, str]:
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, indices))}
