"""The training console on CPU: plain/json/rich output into buffers, NVML with fakes, number formatting."""

from __future__ import annotations

import io
import json
import re
import sys
import types

import pytest

from rawgpu.cli import console as con
from rawgpu.cli.console import EpochStats, GpuReading, GpuReadings, RunInfo, Summary, make_console

INFO = RunInfo(device_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132,
               driver_version="580.159.04 (CUDA 13.0)", nvrtc_version="13.0", model="784-256-256-256-10",
               parameters=335_114, arena_bytes=3 * 2**20 // 2, batch=64, epochs=10, total_steps=9370,
               steps_per_epoch=937, lr=0.1, optimizer="SGD with momentum 0.9", schedule="cosine", accum="fp32", graph=True,
               steps_per_graph=1, pci_bus_id="0000:19:00.0", compile_note="kernel cache: warm (12 ms)")
STATS = EpochStats(epoch=3, epochs=10, steps=937, train_loss=0.08123, train_accuracy=0.9761, test_loss=0.0712,
                   test_accuracy=0.9785, seconds=0.0841, eval_seconds=0.0042, steps_per_s=11141.5,
                   samples_per_s=713056.0, tflops=4.56, gbps=123.4, lr=0.05, total_seconds=0.25)
DONE = Summary(train_seconds=0.84, wall_seconds=2.91, steps=9370, best_accuracy=0.9821, best_epoch=10,
               time_to_98=0.61, interrupted=False)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeNvml(types.ModuleType):
    """Just enough of pynvml: a GPU at bus 0000:19:00.0 with a given set of unsupported queries."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, fail=(), init_fails=False):
        super().__init__("pynvml")
        self.fail, self.init_fails, self.calls = set(fail), init_fails, []

    def _call(self, name, value):
        self.calls.append(name)
        if name in self.fail:
            raise RuntimeError(f"{name}: not supported")
        return value

    def nvmlInit(self):
        if self.init_fails:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self): return self._call("shutdown", None)
    def nvmlDeviceGetHandleByPciBusId(self, bus): return self._call("by_bus", f"handle:{bus}")
    def nvmlDeviceGetHandleByIndex(self, i): return self._call("by_index", f"handle:{i}")
    def nvmlDeviceGetTemperature(self, h, sensor): return self._call("temp", 65)
    def nvmlDeviceGetPowerUsage(self, h): return self._call("power", 251_500)
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return self._call("limit", 700_000)
    def nvmlDeviceGetMemoryInfo(self, h): return self._call("mem", types.SimpleNamespace(used=2**30, total=80 * 2**30))
    def nvmlDeviceGetUtilizationRates(self, h): return self._call("util", types.SimpleNamespace(gpu=97))
    def nvmlDeviceGetClockInfo(self, h, clock): return self._call("clock", 1980 if clock == 1 else 0)
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return self._call("reasons", 0x1)  # idle, not capped


def fake_nvml(monkeypatch, **kw) -> FakeNvml:
    nv = FakeNvml(**kw)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


def run_all(console) -> None:
    console.message("compiling kernels for sm_90 (first run, ~1 min)...")
    console.start(INFO)
    console.epoch_begin(3, 10, 937)
    for done in range(0, 938, 100):
        console.epoch_progress(done)
    console.epoch_end(STATS)
    console.finish(DONE)
    console.close()


# ---- formatting ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x, text", [(0, "0.00"), (5.5, "5.50"), (999, "999"), (999.6, "1.00k"), (1234, "1.23k"),
                                     (12345.6, "12.3k"), (713056, "713k"), (2.5e6, "2.50M"), (4e12, "4.00T")])
def test_format_rate(x, text):
    assert con.format_rate(x) == text


@pytest.mark.parametrize("s, text", [(0.84, "0.84 s"), (9.994, "9.99 s"), (41.23, "41.2 s"), (125, "2m 05s"),
                                     (3720, "1h 02m")])
def test_format_seconds(s, text):
    assert con.format_seconds(s) == text


def test_format_summary_variants():
    assert con.format_summary(DONE) == ("trained 9370 steps in 0.84 s (wall 2.91 s); best test accuracy 98.21% "
                                        "(epoch 10); reached 98% after 0.61 s")
    slow = Summary(0.84, 2.91, 9370, 0.9790, 9, None, False)
    assert con.format_summary(slow).endswith("best test accuracy 97.90% (epoch 9); 98% not reached")
    stopped = Summary(0.1, 0.5, 100, 0.0, 0, None, True)
    assert con.format_summary(stopped) == ("interrupted: trained 100 steps in 0.10 s (wall 0.50 s); "
                                           "no epoch finished; 98% not reached")


def test_format_gpu():
    r = GpuReading(65, 251.5, 700.0, 2**30, 80 * 2**30, 97, 1980, False)
    assert con.format_gpu(r) == "GPU 65 °C  252 W / 700 W  1980 MHz  mem 1.00 GiB / 80.00 GiB  util 97%"
    assert con.format_gpu(r, full=False) == "GPU 65 °C  252 W"
    capped = GpuReading(70, 691.2, 700.0, 2**30, 80 * 2**30, 100, 1845, True)
    assert con.format_gpu(capped) == ("GPU 70 °C  691 W / 700 W, power-capped  1845 MHz  mem 1.00 GiB / 80.00 GiB  "
                                      "util 100%")
    assert con.format_gpu(GpuReading(temperature_c=40)) == "GPU 40 °C  n/a W  n/a MHz  mem n/a / n/a  util n/a%"
    assert con.format_gpu(None) == "GPU n/a"


def test_header_rows_describe_the_run():
    rows = dict(con.header_rows(INFO))
    assert rows["device"] == "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)"
    assert rows["model"] == "784-256-256-256-10, 335,114 parameters, arena 1.50 MiB"
    assert rows["launch"] == "CUDA graph (1 step per graph)" and rows["kernels"] == INFO.compile_note
    eager = dict(con.header_rows(RunInfo(**{**INFO.__dict__, "graph": False, "compile_note": ""})))
    assert eager["launch"] == "eager launches (--no-graph)" and "kernels" not in eager


# ---- plain / json / auto ------------------------------------------------------------------------------------------

def test_plain_mode(monkeypatch):
    fake_nvml(monkeypatch)
    out = io.StringIO()
    run_all(make_console("plain", stream=out))
    text = out.getvalue()
    lines = text.splitlines()
    assert "\x1b" not in text
    assert lines[0] == "compiling kernels for sm_90 (first run, ~1 min)..."
    assert "NVIDIA H100 80GB HBM3" in text and "784-256-256-256-10" in text
    epoch = next(line for line in lines if line.startswith("epoch 3/10"))
    assert "test acc 97.85%" in epoch and "11.1k steps/s" in epoch and "713k samples/s" in epoch
    assert epoch.endswith("| GPU 65 °C  252 W")
    assert lines[-1] == con.format_summary(DONE)


def test_plain_mode_without_nvml_has_no_gpu_suffix(monkeypatch):
    fake_nvml(monkeypatch, init_fails=True)
    out = io.StringIO()
    with make_console("plain", stream=out) as console:
        console.epoch_end(STATS)
        console.finish(Summary(0.5, 1.0, 937, 0.9785, 3, None, True))
    last_epoch, summary = out.getvalue().splitlines()
    assert last_epoch.endswith("0.08 s") and "GPU" not in last_epoch
    assert summary.startswith("interrupted: trained 937 steps") and summary.endswith("98% not reached")


def test_json_mode_prints_only_epoch_records(monkeypatch):
    fake_nvml(monkeypatch)
    out = io.StringIO()
    console = make_console("json", stream=out)
    run_all(console)
    nan = EpochStats(**{**STATS.__dict__, "epoch": 4, "train_loss": float("nan")})
    console.epoch_end(nan)  # after close(): NVML is shut down, so no readings
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["test_accuracy"] == 0.9785 and first["epoch"] == 3 and first["steps_per_s"] == 11141.5
    assert set(first) == set(STATS.__dict__) | {"gpu"}
    assert first["gpu"] == {"temperature_c": 65, "power_w": 251.5, "memory_used_bytes": 2**30, "utilization_pct": 97,
                            "sm_clock_mhz": 1980, "power_capped": False}
    assert second["train_loss"] is None and second["gpu"] is None and "NaN" not in out.getvalue()


def test_json_mode_is_silent_except_epochs():
    out = io.StringIO()
    console = make_console("json", stream=out)
    console.message("hello")
    console.start(INFO)
    console.epoch_begin(1, 10, 937)
    console.epoch_progress(5)
    console.finish(DONE)
    console.close()
    assert out.getvalue() == ""


def test_auto_mode_picks_by_tty():
    assert isinstance(make_console(stream=io.StringIO()), con.PlainConsole)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    console = make_console("auto", stream=Tty())
    assert isinstance(console, con.RichConsole)
    console.close()
    with pytest.raises(ValueError, match="mode"):
        make_console("fancy")


# ---- rich ---------------------------------------------------------------------------------------------------------

def test_rich_mode_renders_header_table_and_summary(monkeypatch):
    from rich.console import Console as RichTerminal

    fake_nvml(monkeypatch)
    buf = io.StringIO()
    console = make_console("rich", rich_console=RichTerminal(file=buf, force_terminal=True, width=120))
    run_all(console)
    console.close()  # idempotent
    text = ANSI.sub("", buf.getvalue())
    assert "\x1b" in buf.getvalue()  # it really drew for a terminal
    assert "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)" in text and "kernel cache: warm" in text
    assert "97.85%" in text and "11.1k" in text and "epoch 3/10" in text
    assert "GPU 65 °C  252 W / 700 W" in text
    assert text.rstrip().endswith(con.format_summary(DONE))
    assert not console.live.is_started


def test_rich_progress_is_a_cheap_store():
    from rich.console import Console as RichTerminal

    console = make_console("rich", rich_console=RichTerminal(file=io.StringIO(), force_terminal=True, width=120))
    console.epoch_begin(1, 2, 100)
    console.epoch_progress(42)
    assert console._done == 42
    console.__rich__()  # what the refresh thread does: hand the number to the progress bar
    assert console.progress.tasks[0].completed == 42 and console.progress.tasks[0].total == 100
    console.close()


# ---- NVML ---------------------------------------------------------------------------------------------------------

def test_gpu_readings_without_nvml_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    gpu = GpuReadings(interval=0)
    assert gpu.read() is None and gpu.read() is None
    gpu.shutdown()
    gpu.shutdown()


def test_gpu_readings_without_gpu(monkeypatch):
    nv = fake_nvml(monkeypatch, fail={"by_bus", "by_index"})
    gpu = GpuReadings("0000:19:00.0", interval=0)
    assert gpu.read() is None
    assert nv.calls == ["by_bus", "by_index", "shutdown"]  # NVML was shut down again right away


def test_gpu_readings_find_the_bus_and_convert_units(monkeypatch):
    nv = fake_nvml(monkeypatch, fail={"util"})
    gpu = GpuReadings("0000:19:00.0", interval=0)
    r = gpu.read()
    assert nv.calls[0] == "by_bus" and "by_index" not in nv.calls
    assert r == GpuReading(temperature_c=65, power_w=251.5, power_limit_w=700.0, memory_used_bytes=2**30,
                           memory_total_bytes=80 * 2**30, utilization_pct=None, sm_clock_mhz=1980, power_capped=False)
    gpu.shutdown()
    gpu.shutdown()
    assert nv.calls.count("shutdown") == 1 and gpu.read() is None


def test_gpu_readings_tell_when_the_power_limit_holds_the_clock(monkeypatch):
    """NVML's software power cap (0x4) or hardware power brake (0x80) among the clock's event reasons: power_capped;
    a GPU that does not report the clock or its reasons: None for those, the other readings as before."""
    nv = fake_nvml(monkeypatch)
    for mask, capped in ((0x4, True), (0x80 | 0x1, True), (0x1, False), (0x0, False)):
        nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h, mask=mask: mask
        r = GpuReadings("0000:19:00.0", interval=0).read()
        assert r.power_capped is capped and r.sm_clock_mhz == 1980
    nv = fake_nvml(monkeypatch, fail={"clock", "reasons"})
    r = GpuReadings("0000:19:00.0", interval=0).read()
    assert r.sm_clock_mhz is None and r.power_capped is None and r.temperature_c == 65


def test_gpu_readings_fall_back_to_index_and_throttle(monkeypatch):
    nv = fake_nvml(monkeypatch, fail={"by_bus"})
    gpu = GpuReadings("0000:19:00.0", interval=60)
    assert gpu.read().temperature_c == 65 and "by_index" in nv.calls
    calls = len(nv.calls)
    assert gpu.read().temperature_c == 65 and len(nv.calls) == calls  # cached within the interval


def test_gpu_readings_on_this_machine_never_raise():
    gpu = GpuReadings()
    r = gpu.read()
    assert r is None or isinstance(r, GpuReading)
    gpu.shutdown()
