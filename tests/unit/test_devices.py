import pytest

from duoka.errors import DuokaError
from duoka.host.devices import GpuReading, compute_dtype_name, device_env, select_gpus

GPUS = [GpuReading(0, "GPU-aaa", "H200", 70000, 143771, 95), GpuReading(1, "GPU-bbb", "H200", 500, 143771, 0),
        GpuReading(2, "GPU-ccc", "H200", 300, 143771, 0), GpuReading(3, "GPU-ddd", "H200", 20000, 143771, 40)]


def test_all_visible_by_default():
    assert select_gpus(None, None, GPUS) == [0, 1, 2, 3]


def test_explicit_list_and_existing_visible_devices():
    assert select_gpus("0,3", None, GPUS) == [0, 3]
    assert select_gpus(None, "3,1", GPUS) == [3, 1]
    assert select_gpus(None, "GPU-ccc", GPUS) == [2]
    with pytest.raises(DuokaError, match=r"GPU 0 is not among the GPUs CUDA_VISIBLE_DEVICES=2,3 offers"):
        select_gpus("0", "2,3", GPUS)


def test_auto_picks_least_busy():
    assert select_gpus("auto:2", None, GPUS) == [1, 2]
    assert select_gpus("auto:3", None, GPUS) == [1, 2, 3]
    assert select_gpus("auto:1", "0,3", GPUS) == [3]
    with pytest.raises(DuokaError, match="asks for 5 GPUs but 4 are visible"):
        select_gpus("auto:5", None, GPUS)


def test_bad_specs():
    with pytest.raises(DuokaError, match="not a list of GPU indices"):
        select_gpus("zero", None, GPUS)
    with pytest.raises(DuokaError, match="names a GPU twice"):
        select_gpus("1,1", None, GPUS)
    with pytest.raises(DuokaError, match="no GPU is visible"):
        select_gpus("0", None, [])


def test_env_sets_pci_bus_order():
    assert device_env([0, 3]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,3"}


def test_compute_dtype_name_resolves_auto_by_device():
    assert compute_dtype_name("auto", "cuda") == "bfloat16"
    assert compute_dtype_name("auto", "cpu") == "float32"
    assert [compute_dtype_name(c, "cpu") for c in ("bf16", "bfloat16", "fp32", "float32", "float16")] == \
        ["bfloat16", "bfloat16", "float32", "float32", "float16"]
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        compute_dtype_name("int8", "cuda")
