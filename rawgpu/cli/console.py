"""The training console: a live rich view on a terminal, plain lines in a log, or JSON lines for scripts.

train.py reports through one small interface (start, message, epoch_begin/progress/end, finish, close) and never
formats anything itself. epoch_progress sits in the hot host loop, so it only stores a number; drawing happens on
rich's own refresh thread. GPU sensors come from NVML, and a machine without NVML just shows "n/a".
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console as RichTerminal
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TransferSpeedColumn)
from rich.table import Table
from rich.text import Text

from ..runtime.memory import format_bytes
from ..training.stats import EpochStats


@dataclass(frozen=True)
class RunInfo:
    """What the header shows: the GPU, the toolchain, the model and the recipe, known before the first step."""

    device_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    driver_version: str  # "580.159.04 (CUDA 13.0)"
    nvrtc_version: str
    model: str
    parameters: int
    arena_bytes: int
    batch: int
    epochs: int
    total_steps: int
    steps_per_epoch: int
    lr: float
    optimizer: str  # Recipe.optimizer_text: "SGD with momentum 0.9", "Adam (betas 0.9, 0.999, eps 1e-08)"
    schedule: str
    accum: str  # "fp32" or "fp16"
    graph: bool  # False: --no-graph, eager launches
    steps_per_graph: int
    pci_bus_id: str | None = None  # finds the same GPU in NVML, whose device order may differ from CUDA's
    compile_note: str = ""
    step: str = ""  # how a step runs (Step.describe): "fused: 1 persistent kernel, ..." or "layered: 18 kernels"
    data: str = ""  # "fashion-mnist: 60000 + 10000 images of 28x28, 10 classes"
    resumed: str = ""  # "from run.safetensors at step 1200"
    ranks: str = ""  # on several GPUs: how many processes, who started them, how long they took to meet


@dataclass(frozen=True)
class Summary:
    """The whole run, for the last line."""

    train_seconds: float
    wall_seconds: float
    steps: int
    best_accuracy: float
    best_epoch: int
    time_to_98: float | None  # cumulative training seconds when test accuracy first reached 98%
    interrupted: bool  # Ctrl-C
    compile_seconds: float = 0.0  # of the wall time, spent building kernels
    best_rmse: float | None = None  # a regression's best test RMSE (best_epoch's); None for a classification


@dataclass(frozen=True)
class GpuReading:
    """One NVML sample; a field the GPU does not report is None."""

    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_pct: int | None = None
    sm_clock_mhz: int | None = None
    power_capped: bool | None = None  # the power limit holds the clock down (docs/perf.md: Power)


# ---- formatting -------------------------------------------------------------------------------------------------

def format_rate(x: float) -> str:
    """Three significant digits with a k/M/G/T suffix: 12345.6 -> "12.3k"."""
    unit = ""
    for unit in ("", "k", "M", "G", "T"):
        if abs(x) < 999.5 or unit == "T":
            break
        x /= 1000
    return f"{x:.{2 if abs(x) < 9.995 else 1 if abs(x) < 99.95 else 0}f}{unit}"


def format_seconds(s: float) -> str:
    """0.84 s, 41.2 s, 2m 05s, 1h 02m: precise for short runs, readable for long ones."""
    if s < 9.995:
        return f"{s:.2f} s"
    if s < 59.95:
        return f"{s:.1f} s"
    m, sec = divmod(round(s), 60)
    return f"{m}m {sec:02d}s" if m < 60 else f"{m // 60}h {m % 60:02d}m"


def _na(value, fmt=str) -> str:
    return "n/a" if value is None else fmt(value)


def format_gpu(r: GpuReading | None, full: bool = True) -> str:
    """Temperature and power; with full=True also power limit, memory and utilisation."""
    if r is None:
        return "GPU n/a"
    parts = [f"{_na(r.temperature_c)} °C", f"{_na(r.power_w, round)} W"]
    if full:
        parts[1] += f" / {r.power_limit_w:.0f} W" if r.power_limit_w is not None else ""
        parts[1] += ", power-capped" if r.power_capped else ""
        parts += [f"{_na(r.sm_clock_mhz)} MHz",
                  f"mem {_na(r.memory_used_bytes, format_bytes)} / {_na(r.memory_total_bytes, format_bytes)}",
                  f"util {_na(r.utilization_pct)}%"]
    return "GPU " + "  ".join(parts)


def format_summary(s: Summary) -> str:
    best = (f"best test accuracy {s.best_accuracy:.2%} (epoch {s.best_epoch})" if s.best_epoch > 0
            else "no epoch finished")
    reached = f"reached 98% after {format_seconds(s.time_to_98)}" if s.time_to_98 is not None else "98% not reached"
    if s.best_rmse is not None:  # a regression: its best RMSE, and no accuracy to reach
        best, reached = f"best test RMSE {s.best_rmse:.4g} (epoch {s.best_epoch})", ""
    compiling = f", of which {format_seconds(s.compile_seconds)} compiling" if s.compile_seconds else ""
    text = (f"trained {s.steps} steps in {format_seconds(s.train_seconds)} (wall {format_seconds(s.wall_seconds)}"
            f"{compiling}); {best}" + (f"; {reached}" if reached else ""))
    return "interrupted: " + text if s.interrupted else text


def format_result(record: dict) -> str:
    """The finished model's test score: 'test set (10000 rows): loss 0.0712, accuracy 97.91%'."""
    if "test_rmse" in record:
        score = (f"RMSE {record['test_rmse']:.4g}, MAE {record['test_mae']:.4g}, R² {record['test_r2']:.4f}")
    else:
        score = f"accuracy {record['test_accuracy']:.2%}"
    return f"test set ({record['test_rows']} rows): loss {record['test_loss']:.4g}, {score}"


def header_rows(info: RunInfo) -> list[tuple[str, str]]:
    """The run's facts as (key, value) rows, shared by the plain header and the rich panel."""
    major, minor = info.compute_capability
    launch = (f"CUDA graph ({info.steps_per_graph} step{'s' * (info.steps_per_graph != 1)} per graph)" if info.graph
              else "eager launches (--no-graph)")
    rows = [("device", f"{info.device_name} (sm_{major}{minor}, {info.sm_count} SMs)"),
            ("driver", f"{info.driver_version}, NVRTC {info.nvrtc_version}")]
    rows += [("data", info.data)] if info.data else []
    rows += [("resumed", info.resumed)] if info.resumed else []
    rows += [
            ("model", f"{info.model}, {info.parameters:,} parameters, arena {format_bytes(info.arena_bytes)}"),
            ("recipe", (f"batch {info.batch}, {info.epochs} epochs x {info.steps_per_epoch} steps = "
                        f"{info.total_steps} steps, {info.optimizer}, lr {info.lr:g} ({info.schedule}), "
                        f"{info.accum} accum")),
            ("launch", f"{launch}; {info.step}" if info.step else launch)]
    rows += [("ranks", info.ranks)] if info.ranks else []
    return rows + [("kernels", info.compile_note)] if info.compile_note else rows


COLUMNS = ("epoch", "train loss", "test acc", "steps/s", "samples/s", "TFLOP/s", "GB/s", "time")
REGRESSION_COLUMNS = tuple("test" if c == "test acc" else c for c in COLUMNS)  # test_cell: RMSE and R²


def test_cell(s: EpochStats) -> str:
    """The test column: the accuracy, or a regression's RMSE and R^2."""
    if s.test_rmse is None:
        return f"{s.test_accuracy:.2%}"
    return f"RMSE {s.test_rmse:.4g} R² {s.test_r2:.3f}" if s.test_r2 is not None else f"RMSE {s.test_rmse:.4g}"


def epoch_cells(s: EpochStats) -> tuple[str, ...]:
    """One epoch's values, in COLUMNS order."""
    return (f"{s.epoch}/{s.epochs}", f"{s.train_loss:.4f}", test_cell(s), format_rate(s.steps_per_s),
            format_rate(s.samples_per_s), f"{s.tflops:.2f}", f"{s.gbps:.0f}", format_seconds(s.seconds))


# ---- NVML -------------------------------------------------------------------------------------------------------

# NVML's clock event reasons that mean the power limit: the software power cap, the hardware power brake
POWER_CAP_REASONS = 0x4 | 0x80


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 -- NVMLError, OSError, a function this pynvml lacks: all mean "no reading"
        return None


class GpuReadings:
    """NVML sensors of the training GPU, sampled at most once per `interval` s (reads in between get the cache).

    NVML is optional: a missing library, no GPU or an unsupported query yields None, never an exception. Thread-safe,
    because rich's refresh thread reads it while the main thread may too.
    """

    def __init__(self, pci_bus_id: str | None = None, interval: float = 0.25):
        self.pci_bus_id, self.interval = pci_bus_id, interval
        self._nv: Any = None
        self._handle: Any = None
        self._state = "new"  # -> "on" or "off"
        self._last: GpuReading | None = None
        self._at = -math.inf
        self._lock = threading.Lock()

    def _open(self) -> None:
        self._state = "off"
        try:
            import pynvml as nv

            nv.nvmlInit()
        except Exception:  # noqa: BLE001 -- no pynvml, no libnvidia-ml, no driver: run on without readings
            return
        # pynvml's ByPciBusId calls the C nvmlDeviceGetHandleByPciBusId_v2; the bus id tells the same GPU
        # even when CUDA and NVML number devices differently.
        self._handle = _try(nv.nvmlDeviceGetHandleByPciBusId, self.pci_bus_id) if self.pci_bus_id else None
        if self._handle is None:
            self._handle = _try(nv.nvmlDeviceGetHandleByIndex, 0)
        if self._handle is None:
            _try(nv.nvmlShutdown)
            return
        self._nv, self._state = nv, "on"

    def _sample(self) -> GpuReading | None:
        nv, h = self._nv, self._handle
        power, limit = _try(nv.nvmlDeviceGetPowerUsage, h), _try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        mem, util = _try(nv.nvmlDeviceGetMemoryInfo, h), _try(nv.nvmlDeviceGetUtilizationRates, h)
        clock = _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        reasons = _try(lambda: (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)  # since driver 535
                                or nv.nvmlDeviceGetCurrentClocksThrottleReasons)(h))
        r = GpuReading(temperature_c=_try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                       power_w=power / 1000 if power is not None else None,
                       power_limit_w=limit / 1000 if limit is not None else None,
                       memory_used_bytes=mem.used if mem is not None else None,
                       memory_total_bytes=mem.total if mem is not None else None,
                       utilization_pct=util.gpu if util is not None else None, sm_clock_mhz=clock,
                       power_capped=bool(reasons & POWER_CAP_REASONS) if reasons is not None else None)
        return None if r == GpuReading() else r

    def read(self) -> GpuReading | None:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.interval:
                self._at = now
                if self._state == "new":
                    self._open()
                self._last = self._sample() if self._state == "on" else None
            return self._last

    def shutdown(self) -> None:
        with self._lock:
            if self._state == "on":
                _try(self._nv.nvmlShutdown)
            self._state, self._last = "off", None


# ---- consoles -----------------------------------------------------------------------------------------------------

class Console:
    """Silent base: every hook is a no-op, so JSON mode only overrides epoch_end."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stdout
        self.gpu = GpuReadings()
        self._closed = False

    def start(self, info: RunInfo) -> None:
        self.gpu.pci_bus_id = info.pci_bus_id

    def message(self, text: str) -> None: ...
    def download(self, name: str, done: int, total: int | None) -> None: ...
    def reading(self, name: str, done: int, total: int) -> None: ...

    def result(self, record: dict) -> None:
        """The finished model's test score (--val-fraction), one line."""
        self.message(format_result(record))
    def compiling(self, done: int, total: int) -> None: ...
    def epoch_begin(self, epoch: int, epochs: int, steps: int) -> None: ...
    def epoch_progress(self, done: int) -> None: ...
    def epoch_end(self, stats: EpochStats) -> None: ...
    def finish(self, summary: Summary) -> None: ...

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.gpu.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


class PlainConsole(Console):
    """Plain text lines for logs and pipes: no ANSI, no progress bar, flushed per line."""

    _compile_told = False

    def start(self, info: RunInfo) -> None:
        super().start(info)
        for key, value in header_rows(info):
            self._line(f"{key + ':':8} {value}")

    def message(self, text: str) -> None:
        self._line(text)

    def download(self, name: str, done: int, total: int | None) -> None:
        """A line when a file starts and when it is complete (logs get no bar)."""
        if done == 0:
            self._line(f"downloading {name} ({format_bytes(total) if total else 'size unknown'})")
        elif total is not None and done == total:
            self._line(f"downloaded {name}")

    def reading(self, name: str, done: int, total: int) -> None:
        """A line when a data file starts to be read and one when it is read (logs get no bar)."""
        told = self._reads_told = getattr(self, "_reads_told", {})  # file -> whether its end was told
        if name not in told:
            told[name] = False
            self._line(f"reading {name} ({format_bytes(total)})")
        if done >= total and not told[name]:
            told[name] = True
            self._line(f"read {name}")

    def compiling(self, done: int, total: int) -> None:
        """A line when the build starts (logs get no bar); the header's kernels row says how long it took."""
        if not self._compile_told:
            self._compile_told = True
            self._line("compiling kernels (first run for them: they are cached for the next)")

    def epoch_end(self, stats: EpochStats) -> None:
        epoch, loss, acc, steps_s, samples_s, tflops, gbps, secs = epoch_cells(stats)
        test = f"test acc {acc}" if stats.test_rmse is None else f"test {acc}  MAE {stats.test_mae:.4g}"
        line = (f"epoch {epoch}  train loss {loss}  {test}  {steps_s} steps/s  {samples_s} samples/s  "
                f"{tflops} TFLOP/s  {gbps} GB/s  {secs}")
        reading = self.gpu.read()
        self._line(line + (f"  | {format_gpu(reading, full=False)}" if reading else ""))

    def finish(self, summary: Summary) -> None:
        self._line(format_summary(summary))


def json_number(x):
    """A number as JSON can hold it: NaN and infinities as null."""
    return x if not isinstance(x, float) or math.isfinite(x) else None


class JsonConsole(Console):
    """One strict-JSON object per epoch on stdout and nothing else, for scripts (NaN/inf become null); with
    --val-fraction a last one, {"test": {...}}: the finished model's score on the test set."""

    def result(self, record: dict) -> None:
        self._line(json.dumps({"test": {k: json_number(v) for k, v in record.items()}}))

    def epoch_end(self, stats: EpochStats) -> None:
        r = self.gpu.read()
        gpu = None if r is None else {k: getattr(r, k) for k in
                                      ("temperature_c", "power_w", "memory_used_bytes", "utilization_pct",
                                       "sm_clock_mhz", "power_capped")}
        record = {k: json_number(v) for k, v in dataclasses.asdict(stats).items()}
        self._line(json.dumps({**record, "gpu": gpu}))


class RichConsole(Console):
    """A rich Live view (header, epoch progress, epoch table, GPU line) redrawn 4x a second by rich's thread."""

    def __init__(self, stream=None, rich_console=None):
        super().__init__(stream)
        self.rc = rich_console or RichTerminal(file=self.stream)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.rc, auto_refresh=False)
        self._task = None
        self._done = 0
        self._header = None
        self._rows: list[EpochStats] = []
        self._downloads: Progress | None = None
        self._download_tasks: dict[str, int] = {}
        self._compiles: Progress | None = None
        self._reads: Progress | None = None
        self._compile_task = None
        self.live = Live(self, console=self.rc, refresh_per_second=4)

    def __rich__(self):
        if self._task is not None:
            self.progress.update(self._task, completed=self._done)
        rows = list(self._rows)
        regression = bool(rows) and rows[0].test_rmse is not None
        table = Table(*(REGRESSION_COLUMNS if regression else COLUMNS), box=None, header_style="bold")
        for column in table.columns[1:]:
            column.justify = "right"
        for stats in rows:
            table.add_row(*epoch_cells(stats))
        parts = [self._header] if self._header is not None else []
        return Group(*parts, self.progress, table, format_gpu(self.gpu.read()))

    def start(self, info: RunInfo) -> None:
        super().start(info)
        grid = Table.grid(padding=(0, 2))
        for key, value in header_rows(info):
            grid.add_row(Text(key, style="bold"), Text(value))  # Text: a "[" in a value is not markup
        self._header = Panel(grid, title="rawgpu", expand=False)
        self.live.start()

    def message(self, text: str) -> None:
        self.rc.print(text, markup=False, highlight=False)

    def download(self, name: str, done: int, total: int | None) -> None:
        """A transient bar per file while the dataset downloads (before the live view starts)."""
        if self._downloads is None:
            self._downloads = Progress(TextColumn("downloading {task.description}"), BarColumn(),
                                       DownloadColumn(), TransferSpeedColumn(), console=self.rc, transient=True)
            self._downloads.start()
        if name not in self._download_tasks:
            self._download_tasks[name] = self._downloads.add_task(name, total=total)
        self._downloads.update(self._download_tasks[name], completed=done, total=total)
        if total is not None and done >= total:
            self._downloads.remove_task(self._download_tasks.pop(name))
            if not self._download_tasks:
                self._downloads.stop()
                self._downloads = None

    def reading(self, name: str, done: int, total: int) -> None:
        """A transient bar while a data file is read (before the live view starts)."""
        finished = self._reads_done = getattr(self, "_reads_done", set())
        if name in finished:
            return
        if done >= total:
            finished.add(name)
        if self._reads is None:
            self._reads = Progress(TextColumn("reading {task.description}"), BarColumn(), DownloadColumn(),
                                   TransferSpeedColumn(), TimeElapsedColumn(), console=self.rc, transient=True)
            self._read_task = self._reads.add_task(name, total=total)
            self._reads.start()
        self._reads.update(self._read_task, completed=done, total=total)
        if done >= total:
            self._reads.stop()
            self._reads = None

    def compiling(self, done: int, total: int) -> None:
        """A transient bar of the units of compilation built (before the live view starts); called from the
        build threads too, which rich's Progress allows."""
        if self._compiles is None:
            self._compiles = Progress(TextColumn("compiling kernels"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=self.rc, transient=True)
            self._compile_task = self._compiles.add_task("", total=total)
            self._compiles.start()
        self._compiles.update(self._compile_task, completed=done, total=total)
        if done >= total:
            self._compiles.stop()
            self._compiles = None

    def epoch_begin(self, epoch: int, epochs: int, steps: int) -> None:
        self._done = 0
        if self._task is None:
            self._task = self.progress.add_task("", total=steps)
        self.progress.reset(self._task, total=steps, description=f"epoch {epoch}/{epochs}")

    def epoch_progress(self, done: int) -> None:
        self._done = done

    def epoch_end(self, stats: EpochStats) -> None:
        self._done = stats.steps
        self._rows.append(stats)

    def finish(self, summary: Summary) -> None:
        self.live.stop()  # the last frame stays on screen; the summary goes below it
        self.rc.print(format_summary(summary), markup=False, highlight=False)

    def close(self) -> None:
        if self._downloads is not None:
            self._downloads.stop()
        self.live.stop()
        super().close()


def make_console(mode: str = "auto", stream=None, rich_console=None) -> Console:
    """mode "auto" picks rich on a terminal and plain otherwise; "rich", "plain" and "json" force one."""
    stream = stream if stream is not None else sys.stdout
    if mode == "auto":
        mode = "rich" if getattr(stream, "isatty", lambda: False)() else "plain"
    if mode == "rich":
        return RichConsole(stream, rich_console)
    if mode == "plain":
        return PlainConsole(stream)
    if mode == "json":
        return JsonConsole(stream)
    raise ValueError(f"console mode must be auto, rich, plain or json, got {mode!r}")
