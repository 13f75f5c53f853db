"""duoka doctor's checks on hand-written facts (each check's PASS, WARN and FAIL), and the
real command end to end on this CPU machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

from duoka.doctor.checks import (
    FAIL,
    INFO,
    PASS,
    WARN,
    Facts,
    GpuFacts,
    check_env,
    check_gpus,
    check_host,
    check_interconnect,
    check_memory_for,
    check_port_and_disk,
    check_python_torch,
    exit_code,
)

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]


def h200(i, **kw):
    return GpuFacts(i, "NVIDIA H200", f"GPU-{i}", (9, 0), 141 * GIB, 1 * GIB, **kw)


def facts(**kw):
    base = dict(python=(3, 11, 7), torch_version="2.11.0+cu130", torch_cuda="13.0", driver_version="580.159.04",
                driver_cuda=(13, 0), nccl_version="2.27.7", gpus=[h200(0), h200(1)],
                links={(0, 1): "NVLink x18"}, p2p={(0, 1): True}, cpu_cores=32, ram_bytes=256 * GIB,
                shm_bytes=128 * GIB, env={}, port_free=True, disk_free=500 * GIB)
    base.update(kw)
    return Facts(**base)


def statuses(results):
    return {(r.check, r.status) for r in results}


def test_a_healthy_two_gpu_machine_passes():
    f = facts()
    results = [*check_python_torch(f), *check_gpus(f), *check_host(f), *check_interconnect(f), *check_env(f),
               *check_port_and_disk(f)]
    assert {r.status for r in results} == {PASS} and exit_code(results) == 0
    assert any("NVLink x18, P2P" in r.detail for r in results)


def test_torch_against_the_driver():
    too_new = check_python_torch(facts(torch_cuda="13.0", driver_cuda=(12, 4), driver_version="550.54"))
    assert ("pytorch", FAIL) in statuses(too_new) and "supports CUDA up to 12.4" in too_new[1].detail
    cpu_build = check_python_torch(facts(torch_cuda=None))
    assert ("pytorch", FAIL) in statuses(cpu_build) and "CPU build" in cpu_build[1].detail
    assert ("pytorch", FAIL) in statuses(check_python_torch(facts(torch_version="2.4.1+cu121")))
    assert ("python", FAIL) in statuses(check_python_torch(facts(python=(3, 9, 1))))


def test_gpu_findings():
    busy = h200(1, processes=[(4242, "python3", 60 * GIB)])
    old = GpuFacts(2, "Tesla V100", "GPU-2", (7, 0), 32 * GIB, 0)
    hot = h200(3, temperature_c=89, clock_reasons=["thermal (software)"])
    broken = h200(4, ecc_uncorrected=3)
    results = check_gpus(facts(gpus=[h200(0), busy, old, hot, broken]))
    text = {r.check: (r.status, r.detail, r.fix) for r in results}
    assert text["gpus"][0] == WARN and "mixed" in text["gpus"][2]
    assert text["gpu 1"][0] == WARN and "python3 (pid 4242, 60.0 GiB)" in text["gpu 1"][1]
    assert text["gpu 2"][0] == WARN and "no bf16" in text["gpu 2"][1]
    assert text["gpu 3"][0] == WARN and "thermal (software) at 89 C" in text["gpu 3"][1]
    assert text["gpu 4"][0] == FAIL and "3 uncorrected ECC" in text["gpu 4"][1]
    cpu = check_gpus(facts(gpus=[]))
    assert cpu[0].status == INFO and "CPU mode" in cpu[0].detail


def test_memory_for_the_model_comes_from_the_planner():
    ok = check_memory_for("qwen2-7b", 2, 140)
    assert ok[0].status == PASS and "GiB per GPU" in ok[0].detail
    too_big = check_memory_for("qwen2-72b", 8, 80)
    assert too_big[0].status == FAIL and "24 GPUs" in too_big[0].fix


def test_host_shm_links_ib_env_port_disk():
    small_shm = check_host(facts(shm_bytes=64 * 2**20, cpu_cores=4))
    assert ("shm", FAIL) in statuses(small_shm) and ("cpu", WARN) in statuses(small_shm)
    assert "--shm-size" in next(r.fix for r in small_shm if r.check == "shm")
    pcie = check_interconnect(facts(links={(0, 1): "PCIe (across NUMA nodes (SMP))"}, p2p={(0, 1): False},
                                    infiniband=[("mlx5_0/1", "1: DOWN", "100 Gb/sec"), ("mlx5_1/1", "4: ACTIVE", "400 Gb/sec (4X NDR)")]))
    assert ("link 0-1", WARN) in statuses(pcie) and ("ib mlx5_0/1", WARN) in statuses(pcie)
    assert ("ib mlx5_1/1", PASS) in statuses(pcie)
    env = check_env(facts(env={"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"},
                          gpus=[h200(0), GpuFacts(1, "NVIDIA A100", "GPU-1", (8, 0), 80 * GIB, 0)]))
    assert [r.detail.split("=")[0] for r in env if r.check == "env"] == ["NCCL_P2P_DISABLE", "NCCL_DEBUG"]
    order = check_env(facts(env={"CUDA_VISIBLE_DEVICES": "1,0"},
                            gpus=[h200(0), GpuFacts(1, "NVIDIA A100", "GPU-1", (8, 0), 80 * GIB, 0)]))
    assert ("gpu order", WARN) in statuses(order)
    port = check_port_and_disk(facts(port_free=False, disk_free=50 * GIB), checkpoint_bytes=90 * GIB)
    assert ("port", FAIL) in statuses(port) and ("disk", FAIL) in statuses(port)
    assert "ss -ltnp" in port[0].fix
    assert exit_code(port) == 2 and exit_code(env) == 1


def test_doctor_on_this_cpu_machine_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "duoka.cli", "doctor", "--json", "--model", "qwen2-0.5b"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_code"] in (0, 1, 2)
    by_check = {r["check"]: r for r in report["results"]}
    if not by_check["gpus"]["status"] == INFO:
        return  # a GPU machine: the CPU-mode statements below do not apply
    assert "CPU mode" in by_check["gpus"]["detail"] and by_check["pytorch"]["status"] == PASS
    assert by_check["memory"]["status"] == INFO and "duoka plan" in by_check["memory"]["fix"]
    assert {"python", "shm", "port", "disk"} <= set(by_check)


def test_allreduce_figures_follow_nccl_tests():
    """algbw = bytes / time; busbw = algbw x 2(n-1)/n (nccl-tests' PERFORMANCE.md). The
    probe itself (spawned gloo processes here, NCCL on GPU) runs in `duoka doctor --bench`;
    spawning it costs 11 s of CI, so only its arithmetic is tested here."""
    from duoka.doctor.bandwidth import bandwidth_row

    r = bandwidth_row(2**30, 0.01, world=8)
    assert r["algbw_gbps"] == 2**30 / 0.01 / 1e9
    assert r["busbw_gbps"] == r["algbw_gbps"] * 14 / 8
    assert bandwidth_row(2**20, 1.0, world=2)["busbw_gbps"] == bandwidth_row(2**20, 1.0, world=2)["algbw_gbps"]


class FakeLinks:
    """NVML's NVLink and topology calls for two GPUs wired as `wiring` says."""
    NVML_NVLINK_MAX_LINKS, NVML_NVLINK_DEVICE_TYPE_SWITCH, NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 18, 2, 3, 0

    def __init__(self, wiring: str):
        self.wiring = wiring

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": f"00000000:{h + 1}8:00.0".encode()})()

    def nvmlDeviceGetNvLinkState(self, h, link):
        if self.wiring == "pcie":
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2 if self.wiring == "nvswitch" else 0  # 0: a GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self.nvmlDeviceGetPciInfo(1 - h)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return 0 if self.wiring != "pcie" else 4  # 4: NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 30


def test_link_kind_reads_direct_nvlink_nvswitch_and_pcie():
    from duoka.doctor.checks import _link_kind

    assert _link_kind(FakeLinks("direct"), [0, 1], 0, 1) == "NVLink x18"
    # HGX H100/H200: every link ends at an NVSwitch (this read as PCIe on a real H200 pair once).
    assert _link_kind(FakeLinks("nvswitch"), [0, 1], 0, 1) == "NVLink through NVSwitch (18 links per GPU)"
    assert _link_kind(FakeLinks("pcie"), [0, 1], 0, 1) == "PCIe (PCIe host bridge)"
