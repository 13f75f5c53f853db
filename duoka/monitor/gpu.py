"""Per-GPU readings through NVML (nvidia-ml-py), sampled in a background thread.

NVML numbers GPUs in PCI bus order and ignores CUDA_VISIBLE_DEVICES, so a training rank
finds its GPU by UUID (torch's device properties carry the same UUID), never by index.
Every call that a GPU or driver may not support (SM activity, NVLink counters, clock
event reasons on old drivers) is read as "not available" (None), not as an error: a
monitoring gap must not stop training.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

# NVML clock event (throttle) reason bits -> words; the bit values are NVML's ABI.
CLOCK_EVENT_REASONS = {
    0x0000000000000001: "idle",
    0x0000000000000002: "application clocks setting",
    0x0000000000000004: "power cap (software)",
    0x0000000000000008: "hardware slowdown",
    0x0000000000000010: "sync boost",
    0x0000000000000020: "thermal (software)",
    0x0000000000000040: "thermal (hardware)",
    0x0000000000000080: "power brake (hardware)",
    0x0000000000000100: "display clock setting",
}
# The reasons that mean the GPU runs slower than it could while busy.
THROTTLING = {"power cap (software)", "hardware slowdown", "thermal (software)", "thermal (hardware)",
              "power brake (hardware)"}
POWER_CAP = "power cap (software)"


def decode_clock_reasons(mask: int | None) -> list[str]:
    if not mask:
        return []
    return [word for bit, word in CLOCK_EVENT_REASONS.items() if mask & bit]


@dataclass
class GpuSample:
    index: int  # NVML / nvidia-smi index
    uuid: str
    name: str
    time: float
    utilization_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    power_limit_default_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    clock_reasons: list[str] = field(default_factory=list)
    clock_mask: int = 0  # the raw NVML bits behind clock_reasons
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None  # over the interval since the previous sample
    nvlink_rx_bytes_per_s: float | None = None
    nvlink_kib_totals: tuple[int, int] | None = None  # NVML's cumulative data counters (tx, rx)
    # GPM (Hopper and later): the share of SM cycles with work, and of warp slots in use,
    # over the interval since the previous sample. Utilisation above only says that some
    # kernel ran; these say how much of the GPU it used.
    sm_active_pct: float | None = None
    sm_occupancy_pct: float | None = None

    @property
    def throttled(self) -> list[str]:
        """The clock-slowing reasons worth an alert. A busy H100/H200 runs at its power
        limit by design, so the power cap counts only where the limit was lowered below
        the GPU's default (seen on 2 x H200: every compiled training step at 690 of 700 W
        carries the power-cap reason, with nothing wrong)."""
        lowered = (self.power_limit_w is not None and self.power_limit_default_w is not None
                   and self.power_limit_w < 0.95 * self.power_limit_default_w)
        return [r for r in self.clock_reasons if r in THROTTLING and (r != POWER_CAP or lowered)]

    @property
    def throttle_mask(self) -> int:
        """The NVML bits of `throttled` (how the reasons travel in the per-step gather)."""
        return sum(bit for bit, word in CLOCK_EVENT_REASONS.items() if word in self.throttled)

    def to_dict(self) -> dict:
        return asdict(self)


def _maybe(fn, *args):
    """One NVML query, or None where this GPU or driver does not support it."""
    try:
        return fn(*args)
    except Exception:  # pynvml.NVMLError_NotSupported and relatives: a gap, not a failure
        return None


def nvml_text(value) -> str:
    """NVML strings: bytes from older pynvml, str from newer."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvlink_totals(nvml, handle) -> tuple[int, int] | None:
    """NVLink data sent and received since boot, KiB summed over links; None without NVLink.

    The throughput fields are per link (scopeId = link): read with scope 0 alone they gave
    0.40-0.48 GB/s on an H200 (driver 580) whose DDP all-reduce moved ~7.5 GB/s, about
    1/18 of it, one of its 18 links."""
    tx_field, rx_field = nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    links = range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, [(f, link) for link in links for f in (tx_field, rx_field)])
    except Exception:
        return None
    pairs = [(int(values[2 * i].value.ullVal), int(values[2 * i + 1].value.ullVal)) for i in range(len(links))
             if values[2 * i].nvmlReturn == 0 and values[2 * i + 1].nvmlReturn == 0]
    if not pairs:
        return None
    return sum(tx for tx, _ in pairs), sum(rx for _, rx in pairs)


def with_rates(sample: GpuSample, previous: GpuSample | None) -> GpuSample:
    """Fill the NVLink rates from the counters' change since the previous sample."""
    if previous is not None and sample.nvlink_kib_totals and previous.nvlink_kib_totals:
        dt = sample.time - previous.time
        if dt > 0:
            sample.nvlink_tx_bytes_per_s = (sample.nvlink_kib_totals[0] - previous.nvlink_kib_totals[0]) * 1024 / dt
            sample.nvlink_rx_bytes_per_s = (sample.nvlink_kib_totals[1] - previous.nvlink_kib_totals[1]) * 1024 / dt
    return sample


def read_sample(nvml, handle, index: int) -> GpuSample:
    """One reading of one GPU. `nvml` is the pynvml module (or a stand-in in tests)."""
    mem = _maybe(nvml.nvmlDeviceGetMemoryInfo, handle)
    util = _maybe(nvml.nvmlDeviceGetUtilizationRates, handle)
    power = _maybe(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
    limit = _maybe(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    default_limit = _maybe(getattr(nvml, "nvmlDeviceGetPowerManagementDefaultLimit", None) or (lambda h: None),
                           handle)
    reasons = _maybe(getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                     or nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    # PCIe counters are KB/s over NVML's last 20 ms window.
    tx = _maybe(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
    rx = _maybe(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
    return GpuSample(
        index=index, uuid=nvml_text(nvml.nvmlDeviceGetUUID(handle)), name=nvml_text(nvml.nvmlDeviceGetName(handle)),
        time=time.time(),
        utilization_pct=None if util is None else int(util.gpu),
        memory_used_bytes=None if mem is None else int(mem.used),
        memory_total_bytes=None if mem is None else int(mem.total),
        temperature_c=_maybe(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        power_w=None if power is None else power / 1000.0,
        power_limit_w=None if limit is None else limit / 1000.0,
        power_limit_default_w=None if default_limit is None else default_limit / 1000.0,
        sm_clock_mhz=_maybe(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
        sm_clock_max_mhz=_maybe(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
        clock_reasons=decode_clock_reasons(reasons), clock_mask=int(reasons or 0),
        pcie_tx_bytes_per_s=None if tx is None else tx * 1024.0,
        pcie_rx_bytes_per_s=None if rx is None else rx * 1024.0,
        nvlink_kib_totals=_nvlink_totals(nvml, handle),
    )


def load_nvml():
    """The initialised pynvml module, or None where there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def read_all(nvml) -> list[GpuSample]:
    return [read_sample(nvml, nvml.nvmlDeviceGetHandleByIndex(i), i) for i in range(nvml.nvmlDeviceGetCount())]


def index_of_uuid(nvml, uuid: str) -> int | None:
    """NVML index of the GPU with this UUID (torch gives it without the "GPU-" prefix)."""
    want = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    for i in range(nvml.nvmlDeviceGetCount()):
        if nvml_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) == want:
            return i
    return None


class SmActivity:
    """SM activity and occupancy through NVML's GPU performance monitoring (GPM), where the
    GPU supports it (Hopper and later). GPM metrics are differences between two samples, so
    each reading compares the sample taken now with the one taken at the previous reading."""

    METRICS = ("sm_active_pct", "sm_occupancy_pct")

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        support = _maybe(getattr(nvml, "nvmlGpmQueryDeviceSupport", None) or (lambda h: None), handle)
        self.supported = bool(support is not None and support.isSupportedDevice)
        self._previous = self._current = None
        if self.supported:
            self._previous, self._current = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
            if _maybe(nvml.nvmlGpmSampleGet, handle, self._previous) is None:
                self.close()

    def read(self) -> dict[str, float | None]:
        """{metric: percent} since the previous read; None values where unsupported."""
        if not self.supported or _maybe(self.nvml.nvmlGpmSampleGet, self.handle, self._current) is None:
            return dict.fromkeys(self.METRICS)
        request = self.nvml.c_nvmlGpmMetricsGet_t()
        request.version = self.nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 2
        request.sample1, request.sample2 = self._previous, self._current
        request.metrics[0].metricId = self.nvml.NVML_GPM_METRIC_SM_UTIL
        request.metrics[1].metricId = self.nvml.NVML_GPM_METRIC_SM_OCCUPANCY
        self._previous, self._current = self._current, self._previous
        if _maybe(self.nvml.nvmlGpmMetricsGet, request) is None:
            return dict.fromkeys(self.METRICS)
        return {name: float(m.value) if m.nvmlReturn == 0 else None
                for name, m in zip(self.METRICS, request.metrics[:2])}

    def close(self) -> None:
        for sample in (self._previous, self._current):
            if sample is not None:
                _maybe(self.nvml.nvmlGpmSampleFree, sample)
        self._previous = self._current = None
        self.supported = False


class GpuSampler:
    """Reads the given GPUs every `interval` seconds in a daemon thread; `latest()` returns
    the last reading without touching NVML, so the training step never waits for it."""

    def __init__(self, nvml, indices: list[int], interval: float = 2.0):
        self.nvml, self.indices, self.interval = nvml, indices, interval
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self.activity = [SmActivity(nvml, h) for h in self.handles]
        self._latest: list[GpuSample] = [read_sample(nvml, h, i) for h, i in zip(self.handles, indices)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duoka-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            latest = []
            for h, i, old, activity in zip(self.handles, self.indices, self._latest, self.activity):
                sample = with_rates(read_sample(self.nvml, h, i), old)
                for name, value in activity.read().items():
                    setattr(sample, name, value)
                latest.append(sample)
            self._latest = latest

    def latest(self) -> list[GpuSample]:
        return self._latest

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # the thread may still hold the GPM samples otherwise
            for activity in self.activity:
                activity.close()
