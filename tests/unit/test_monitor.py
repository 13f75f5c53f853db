"""duoka.monitor: the NVML layer against a fake NVML, alerts, and the TensorBoard and
Prometheus sinks fed one record (the training run that scrapes its live endpoint is in
tests/integration/test_monitoring.py)."""

import re
import time
import urllib.request
from types import SimpleNamespace

from duoka.monitor import gpu
from duoka.monitor.alerts import check
from duoka.monitor.sinks import PrometheusSink, TensorBoardSink


class NotSupported(Exception):
    pass


class FakeNVML:
    """The pynvml calls duoka makes, for two GPUs; GPU 1 lacks PCIe counters and power."""
    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1, 0, 1

    def __init__(self):
        self.util = [97, 40]
        self.reasons = [0, 0x20 | 0x4]  # GPU 1: software thermal slowdown and power cap
        self.nvlink_kib = 0  # cumulative counter, grows by 1000 KiB per read

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000-{h}".encode()  # older pynvml returns bytes

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=[10, 135][h] * 2**30, total=140 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.util[h], memory=0)

    def nvmlDeviceGetTemperature(self, h, kind):
        return [55, 88][h]

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise NotSupported()
        return 650_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, kind):
        return [1980, 1410][h]

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self.reasons[h]

    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139

    NVML_NVLINK_MAX_LINKS = 18
    nvlink_links = 2  # active links on GPU 0; the other 16 answer "not supported"

    def nvmlDeviceGetFieldValues(self, h, fields):
        """Per (field, link): link counters of cumulative KiB, rx twice tx."""
        if h == 1:  # no NVLink: NVML answers "not supported" in each value
            return [SimpleNamespace(nvmlReturn=3, value=SimpleNamespace(ullVal=0)) for _ in fields]
        self.nvlink_kib += 1000
        out = []
        for field, link in fields:
            per_link = self.nvlink_kib * (2 if field == self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX else 1)
            out.append(SimpleNamespace(nvmlReturn=0 if link < self.nvlink_links else 3,
                                       value=SimpleNamespace(ullVal=per_link)))
        return out

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        return 700_000

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        if h == 1:
            raise NotSupported()
        return 1000  # KB/s

    # GPM (SM activity): GPU 0 supports it, GPU 1 does not. A sample snapshots cumulative
    # counters of SM-active and elapsed cycles; a metric compares two samples, as NVML does.
    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_SM_OCCUPANCY = 1, 2, 3
    sm_active_per_read = 60  # of every 100 elapsed cycles; tests change it
    _cycles = (0, 0)

    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=int(h == 0))

    def nvmlGpmSampleAlloc(self):
        return SimpleNamespace(active=None, elapsed=None, freed=False)

    def nvmlGpmSampleFree(self, sample):
        sample.freed = True

    def nvmlGpmSampleGet(self, h, sample):
        active, elapsed = self._cycles
        self._cycles = (active + self.sm_active_per_read, elapsed + 100)
        sample.active, sample.elapsed = self._cycles
        return sample

    def c_nvmlGpmMetricsGet_t(self):
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(4)])

    def nvmlGpmMetricsGet(self, request):
        a, b = request.sample1, request.sample2
        busy = 100.0 * (b.active - a.active) / (b.elapsed - a.elapsed)
        for m in request.metrics[:request.numMetrics]:
            m.value = {self.NVML_GPM_METRIC_SM_UTIL: busy, self.NVML_GPM_METRIC_SM_OCCUPANCY: busy / 2}[m.metricId]
        return request


def test_readings_decoded_and_gaps_are_none():
    nvml = FakeNVML()
    a, b = gpu.read_all(nvml)
    assert (a.uuid, a.name, a.utilization_pct, a.temperature_c, a.power_w, a.sm_clock_mhz) == \
        ("GPU-0000-0", "NVIDIA H200", 97, 55, 650.0, 1980)
    assert a.pcie_tx_bytes_per_s == 1000 * 1024 and a.throttled == []
    assert b.power_w is None and b.pcie_rx_bytes_per_s is None  # not supported: a gap, not an error
    # At its default power limit a busy GPU's power cap is its design point, not an alert.
    assert b.clock_reasons == ["power cap (software)", "thermal (software)"] and b.throttled == ["thermal (software)"]
    assert b.throttle_mask == 0x20
    lowered = gpu.GpuSample(index=0, uuid="u", name="n", time=0.0, clock_reasons=["power cap (software)"],
                            power_limit_w=450.0, power_limit_default_w=700.0)
    assert lowered.throttled == ["power cap (software)"] and lowered.throttle_mask == 0x4
    assert gpu.decode_clock_reasons(0x1) == ["idle"]
    assert gpu.index_of_uuid(nvml, "0000-1") == 1 and gpu.index_of_uuid(nvml, "GPU-9") is None


def test_nvlink_rate_from_the_counters_change():
    nvml = FakeNVML()
    first = gpu.read_sample(nvml, 0, 0)
    second = gpu.read_sample(nvml, 0, 0)
    second.time = first.time + 0.5
    gpu.with_rates(second, first)
    # Summed over the two active links (read per link: scope 0 alone was one link of 18 on H200).
    assert second.nvlink_tx_bytes_per_s == 2 * 1000 * 1024 / 0.5 and second.nvlink_rx_bytes_per_s == 4 * 1000 * 1024 / 0.5
    none = gpu.with_rates(gpu.read_sample(nvml, 1, 1), gpu.read_sample(nvml, 1, 1))
    assert none.nvlink_kib_totals is None and none.nvlink_tx_bytes_per_s is None


def test_sampler_reads_in_the_background():
    nvml = FakeNVML()
    sampler = gpu.GpuSampler(nvml, [1], interval=0.05)
    try:
        assert sampler.latest()[0].utilization_pct == 40
        nvml.util[1] = 77
        deadline = time.time() + 5
        while sampler.latest()[0].utilization_pct != 77 and time.time() < deadline:
            time.sleep(0.02)
        assert sampler.latest()[0].utilization_pct == 77
    finally:
        sampler.close()


def test_sm_activity_compares_each_sample_with_the_previous_one():
    nvml = FakeNVML()
    activity = gpu.SmActivity(nvml, 0)
    assert activity.read() == {"sm_active_pct": 60.0, "sm_occupancy_pct": 30.0}
    nvml.sm_active_per_read = 25  # the GPU got less busy: the next interval shows it alone
    assert activity.read() == {"sm_active_pct": 25.0, "sm_occupancy_pct": 12.5}
    samples = (activity._previous, activity._current)
    activity.close()
    assert all(s.freed for s in samples) and activity.read() == {"sm_active_pct": None, "sm_occupancy_pct": None}
    assert gpu.SmActivity(nvml, 1).read() == {"sm_active_pct": None, "sm_occupancy_pct": None}  # no GPM on GPU 1


def test_sampler_fills_sm_activity_where_supported():
    nvml = FakeNVML()
    sampler = gpu.GpuSampler(nvml, [0, 1], interval=0.05)
    try:
        deadline = time.time() + 5
        while sampler.latest()[0].sm_active_pct is None and time.time() < deadline:
            time.sleep(0.02)
        a, b = sampler.latest()
        assert a.sm_active_pct == 60.0 and a.sm_occupancy_pct == 30.0
        assert b.sm_active_pct is None and b.sm_occupancy_pct is None
    finally:
        sampler.close()


def record(**overrides):
    r = {"step": 7, "loss": 2.5, "loss_max_rank": 2.6, "lr": 1e-3, "grad_norm": 0.9, "tokens": 1000,
         "tokens_per_s": 2e5, "tokens_per_s_per_gpu": 1e5, "mfu": 0.40, "step_time_s": 0.5, "data_time_s": 0.001,
         "phase_s": {"forward": 0.15, "backward": 0.3},
         "per_rank": {"loss": [2.4, 2.6], "step_time_s": [0.5, 0.5], "data_time_s": [0.001, 0.001],
                      "peak_mem_gib": [30.0, 31.0]},
         "gpus": [dict(rank=r, **{k: v for k, v in s.to_dict().items() if k in (
             "index", "utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w",
             "sm_clock_mhz", "clock_reasons")}, throttled=s.throttled) for r, s in enumerate(gpu.read_all(FakeNVML()))]}
    r["gpus"][0]["sm_active_pct"] = 62.5  # GPM: GPU 0 reports SM activity, GPU 1 does not
    r.update(overrides)
    return r


def test_alerts_name_cause_and_fix():
    kinds = {a.kind: a.message for a in check(record(), n_params=5e8)}
    assert set(kinds) == {"imbalance", "throttling", "memory"}
    assert "GPU 1 (rank 1) is 40% busy" in kinds["imbalance"] and "balance=auto" in kinds["imbalance"]
    assert "thermal (software)" in kinds["throttling"] and "88 C" in kinds["throttling"]
    assert "96% full" in kinds["memory"] and "micro_batch_size" in kinds["memory"]
    slow = check(record(gpus=[], data_time_s=0.1, mfu=0.05), n_params=7e9)
    assert [a.kind for a in slow] == ["data_wait", "low_mfu"]
    assert "20% of its time" in slow[0].message and "training.compile" in slow[1].message
    assert check(record(gpus=[]), n_params=7e9) == []  # healthy: silence


def test_prometheus_endpoint_and_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = record(alerts=[{"kind": "memory", "message": "m"}], balance={"mode": "auto", "shares": [5, 3],
                                                                    "speed": [10.0, 6.0], "compute_s": [0.5, 0.5]})
    sink = PrometheusSink("127.0.0.1", 0, ranks=[0, 1])
    try:
        sink.write(r)
        text = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("duoka_")}
    assert lines["duoka_step"] == 7 and lines["duoka_mfu_ratio"] == 0.40
    host = next(k for k in lines if k.startswith("duoka_rank_loss{")).split('host="')[1].split('"')[0]
    assert lines[f'duoka_rank_peak_memory_bytes{{host="{host}",rank="1"}}'] == 31.0 * 2**30
    assert lines[f'duoka_gpu_utilization_ratio{{gpu="1",host="{host}",rank="1"}}'] == 0.40
    assert lines[f'duoka_gpu_sm_active_ratio{{gpu="0",host="{host}",rank="0"}}'] == 0.625
    assert not any(k.startswith("duoka_gpu_sm_active_ratio") and 'rank="1"' in k for k in lines)
    assert lines[f'duoka_gpu_throttled{{gpu="1",host="{host}",rank="1",reason="thermal (software)"}}'] == 1
    assert lines[f'duoka_balance_share_samples{{host="{host}",rank="1"}}'] == 3
    assert lines['duoka_alert{kind="memory"}'] == 1
    assert not any("power_watts" in k and 'rank="1"' in k for k in lines)  # unsupported: absent, not 0

    tb = TensorBoardSink(tmp_path / "tb")
    tb.write(r)
    tb.write(dict(r, step=8, loss=2.0))
    tb.close()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(7, 2.5), (8, 2.0)]
    assert events.Scalars("gpu/temperature_c/rank1")[0].value == 88
    assert events.Scalars("gpu/sm_active_pct/rank0")[0].value == 62.5
    assert events.Scalars("balance/share/rank0")[0].value == 5


def test_live_view_shows_ranks_gpus_shares_and_alerts(tmp_path):
    import json

    from rich.console import Console

    from duoka.monitor.dashboard import gpu_view, ranks_by_gpu, run_view

    r = record(alerts=[{"kind": "memory", "message": "GPU 1 (rank 1) memory 96% full"}],
               balance={"mode": "auto", "shares": [5, 3], "speed": [10.0, 6.0], "compute_s": [0.5, 0.5]})
    console = Console(record=True, width=200)
    console.print(run_view([r], "runs/x"))
    text = console.export_text()
    assert "step 7  loss 2.5000" in text and "MFU 40.0%" in text
    row1 = next(line for line in text.splitlines() if line.strip().startswith("1 "))
    row0 = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert "62%" in row0  # SM activity beside the utilisation
    assert "2.6000" in row1 and "40%" in row1 and "88" in row1 and "thermal (software)" in row1 and " 3 " in row1
    assert "alert (memory): GPU 1 (rank 1) memory 96% full" in text

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(r) + "\n" + '{"step": 8, "lo')  # a line being written
    assert ranks_by_gpu(run) == {0: 0, 1: 1}
    console = Console(record=True, width=200)
    console.print(gpu_view(gpu.read_all(FakeNVML()), {1: 1}))
    lines = console.export_text().splitlines()
    assert any(line.strip().startswith("1 ") and "NVIDIA H200" in line and "135.0 / 140.0" in line for line in lines)


def eight_ranks() -> dict:
    """record() spread over 8 ranks, each with its GPU's readings and a balance share."""
    r = record(balance={"mode": "auto", "shares": [5, 3] * 4, "speed": [10.0, 6.0] * 4, "compute_s": [0.5] * 8})
    r["per_rank"] = {k: v * 4 for k, v in r["per_rank"].items()}
    r["gpus"] = [dict(g, rank=i, index=i) for i, g in enumerate(r["gpus"] * 4)]
    return r


def rank_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()[:2] in {f"{i} " for i in range(8)}]


def test_the_live_view_fits_80_columns_one_line_a_rank():
    """At 80 columns every header stays whole (rich alone squeezed 15 columns to `r… l… s…`),
    each rank is one line, the columns of least use are left out and named."""
    from rich.console import Console

    from duoka.monitor.dashboard import gpu_view, run_view

    console = Console(width=80, record=True, color_system=None)
    console.print(run_view([eight_ranks()], "runs/x"))
    console.print(gpu_view(gpu.read_all(FakeNVML()), {0: 0, 1: 1}))
    text = console.export_text()
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 80, text
    rows = rank_rows(text.split("GPUs (NVML")[0])
    assert len(rows) == 8 and all(len(row.split()) >= 6 for row in rows), text
    header = next(line for line in text.splitlines() if line.startswith("rank "))
    assert {"rank", "loss", "step", "util", "mem", "throttle", "share"} <= set(header.split()), text
    assert "left out at 80 columns: " in text and "step: step ms" in text  # what is not shown, what is short


def test_monitor_once_into_a_pipe_at_80_columns_and_wide(tmp_path, in_process, monkeypatch):
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(eight_ranks()) + "\n")
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe: rich draws at 80 columns
    piped = in_process("monitor", str(run), "--once")
    assert piped.returncode == 0, piped.stderr
    assert "…" not in piped.stdout and len(rank_rows(piped.stdout)) == 8, piped.stdout
    assert "\nstep 7  loss 2.5000" in piped.stdout and "MFU 40.0%" in piped.stdout  # labels beside their values
    assert max(len(line.rstrip()) for line in piped.stdout.splitlines()) <= 80, piped.stdout
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: every column, full headers, nothing left out
    wide = in_process("monitor", str(run), "--once")
    assert "SM MHz" in wide.stdout and "power W" in wide.stdout and "left out" not in wide.stdout
    assert len(rank_rows(wide.stdout)) == 8 and "…" not in wide.stdout


def test_a_cpu_run_shows_no_empty_gpu_columns():
    from rich.console import Console

    from duoka.monitor.dashboard import run_view

    console = Console(width=80, record=True, color_system=None)
    console.print(run_view([record(gpus=[])], "runs/cpu"))
    text = console.export_text()
    assert "util" not in text and "temp" not in text and "left out" not in text  # no readings: no column
    assert "rank" in text and "loss" in text and len(rank_rows(text)) == 2


def test_html_report_has_a_chart_per_reading(tmp_path):
    import json
    from html.parser import HTMLParser

    from duoka.monitor.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    recs = [record(step=s, loss=3.0 - 0.1 * s, balance={"mode": "auto", "shares": [4 + (s > 3), 4 - (s > 3)],
                                                          "speed": [1.0, 0.5], "compute_s": [1, 1]})
            for s in range(1, 7)]
    recs[2]["alerts"] = recs[3]["alerts"] = [{"kind": "data_wait", "message": "the step waited 20%"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "config.toml").write_text("[training]\nsteps = 6\n")
    out = write_report(run)

    class Charts(HTMLParser):
        def __init__(self):
            super().__init__()
            self.captions, self.polylines, self._in_caption = [], [], False

        def handle_starttag(self, tag, attrs):
            self._in_caption = tag == "figcaption"
            if tag == "polyline":
                self.polylines.append(dict(attrs)["points"].split())

        def handle_data(self, data):
            if self._in_caption:
                self.captions.append(data)
                self._in_caption = False

    page = Charts()
    page.feed(out.read_text())
    assert page.captions == ["Loss", "Throughput (tokens/s)", "MFU (%)", "Step breakdown (rank 0, from step 2) (ms)",
                             "GPU utilisation (%)", "SM activity (NVML GPM) (%)", "GPU memory used (GiB)",
                             "Peak allocated memory per rank (GiB)", "Load-balance shares (samples)"]
    # One point per step in every series: loss (2 series), throughput, MFU; the breakdown's
    # two phases from step 2 (step 1 compiles); then the per-GPU charts.
    assert [len(p) for p in page.polylines] == [6] * 4 + [5] * 2 + [6] * (len(page.polylines) - 6)
    # The loss falls: its y pixel coordinate grows (SVG y points down).
    ys = [float(p.split(",")[1]) for p in page.polylines[0]]
    assert ys == sorted(ys) and ys[0] < ys[-1]
    text = out.read_text()
    assert "<b>data_wait</b> (first at step 3): the step waited 20%" in text and "steps = 6" in text
    # Every chart names its axes and marks them with ticks, labelled in order.
    charts = text.split("<figure>")[1:]
    assert len(charts) == len(page.captions)
    for chart, caption in zip(charts, page.captions):
        assert '<text class="x-title"' in chart and ">step</text>" in chart, caption
        unit = caption.rsplit("(", 1)[1].rstrip(")") if caption.endswith(")") else caption
        assert re.search(rf'class="y-title"[^>]*>{re.escape(unit)}</text>', chart), caption
        for axis, least in (("x", 2), ("y", 3)):
            labels = [float(v) for v in re.findall(rf'class="{axis}-tick"[^>]*>([^<]+)</text>', chart)]
            assert len(labels) >= least and labels == sorted(labels), (caption, axis, labels)
        assert chart.count('class="tick"') >= 5
    last = text.split('id="last-record">')[1].split("</script>")[0]
    assert json.loads(last)["step"] == 6  # machine-readable too


def test_grafana_dashboard_uses_only_metrics_that_exist():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "duoka.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"duoka_[a-z_]+", t["expr"])}
    sink = PrometheusSink("127.0.0.1", 0, ranks=[0])
    try:
        defined = {metric.name for metric in sink.registry.collect()}
    finally:
        sink.close()
    assert used and used <= defined, used - defined
