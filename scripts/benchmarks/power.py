"""The GPU's power state while a benchmark runs: NVML readings (rawgpu's GpuReadings: SM clock, power, whether the
power limit holds the clock) taken in a thread, and summed over a span of the run, so that a timing says beside its
number whether it ran at full clock or at the GPU's power limit (docs/perf.md: Power). No NVML: no readings, the
benchmark runs on."""

from __future__ import annotations

import threading
import time

from rawgpu.cli.console import GpuReadings

BUSY_PCT = 50  # a reading under load: the GPU ran kernels at least this share of NVML's last sample period


class PowerLog:
    """Readings of one GPU every `interval` seconds from `start()` to `stop()` (or a with-block), each with its time.
    The default, ten a second, is plenty for runs of seconds and keeps the thread's NVML calls off the timed launches'
    way (dev/power_draw.py, a process of its own, reads faster)."""

    def __init__(self, pci_bus_id: str | None = None, interval: float = 0.1):
        self.gpu, self.interval = GpuReadings(pci_bus_id, interval=0), interval
        self.readings: list = []  # (time.monotonic(), GpuReading)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            r = self.gpu.read()
            if r is None:  # no NVML, or it stopped answering: nothing more to read
                return
            self.readings.append((time.monotonic(), r))
            self._done.wait(self.interval)

    def start(self) -> "PowerLog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.gpu.shutdown()

    def __enter__(self) -> "PowerLog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self, t0: float, t1: float, loaded=None) -> dict | None:
        """The readings under load from t0 to t1 (time.monotonic()): how many, the mean and lowest SM clock, the mean
        power, the share capped by power; None where there are none (no NVML, or no reading under load). loaded: which
        readings count (default: the GPU busy at least BUSY_PCT of NVML's last period)."""
        loaded = loaded or (lambda r: (r.utilization_pct or 0) >= BUSY_PCT)
        got = [r for t, r in self.readings if t0 <= t < t1 and loaded(r)]
        clocks = [r.sm_clock_mhz for r in got if r.sm_clock_mhz is not None]
        watts = [r.power_w for r in got if r.power_w is not None]
        capped = [r.power_capped for r in got if r.power_capped is not None]
        if not got or not (clocks or watts):
            return None
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return dict(readings=len(got), sm_mhz=mean(clocks), sm_mhz_lowest=min(clocks) if clocks else None,
                    watts=mean(watts), capped_pct=100 * sum(capped) / len(capped) if capped else None)


def span_seconds(span: tuple[float, float] | None) -> float | None:
    """A (start, end) span's length in seconds, None for no span."""
    return None if span is None else span[1] - span[0]


def describe(summary: dict | None, seconds: float | None = None) -> str:
    """'1850 MHz (lowest 1680), 689 W, 100% of readings capped by power', or 'no readings' (with the span's length
    where given: a run shorter than NVML's utilization period has no reading under load; more steps give some)."""
    if summary is None:
        return "no readings" if seconds is None else f"no readings under load in its {seconds:.1f} s"
    parts = []
    if summary["sm_mhz"] is not None:
        parts.append(f"{summary['sm_mhz']:.0f} MHz (lowest {summary['sm_mhz_lowest']})")
    if summary["watts"] is not None:
        parts.append(f"{summary['watts']:.0f} W")
    if summary["capped_pct"] is not None:
        parts.append(f"{summary['capped_pct']:.0f}% of readings capped by power")
    return ", ".join(parts)
