"""Whether a run is held by the GPU's power limit: runs a command while sampling NVML (SM clock, power, the clock's
event reasons) and after each line the command prints, prints what the GPU did since the line before: the samples
under load (power at least --loaded-w), their mean and lowest SM clock, mean power and the share capped by power
(software or hardware slowdown by power). A timed run that prints a line per system or variant gets a reading each.

    PYTHONPATH=.:scripts:dev python dev/power_draw.py [--interval-ms 20] [--loaded-w 300] [--every S]
                                                      -- python3 dev/... ARGS

--every S also prints a reading of each S seconds, for a command that prints its lines only at the end.

A kernel that runs at the top clock (1980 MHz on the H200) beside one that runs capped at 700 W shows where energy,
not cycles, sets the time (docs/history.md). Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

CAPPED = 0x4 | 0x80  # nvmlClocksEventReasonSwPowerCap, nvmlClocksEventReasonHwPowerBrakeSlowdown


class Sampler(threading.Thread):
    """NVML readings of GPU `index` every `interval` seconds, (time, SM MHz, watts, reasons) each, until stopped."""

    def __init__(self, index: int, interval: float):
        super().__init__(daemon=True)
        import pynvml as nv

        nv.nvmlInit()
        self.nv, self.handle, self.interval = nv, nv.nvmlDeviceGetHandleByIndex(index), interval
        self.samples: list[tuple[float, int, float, int]] = []
        self.done = threading.Event()

    def run(self):
        nv, h = self.nv, self.handle
        reasons = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)  # its name since driver 535
                   or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        while not self.done.is_set():
            self.samples.append((time.monotonic(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                 nv.nvmlDeviceGetPowerUsage(h) / 1e3, reasons(h)))
            time.sleep(self.interval)

    def since(self, t0: float, t1: float, loaded_w: float) -> str:
        got = [s for s in self.samples if t0 <= s[0] < t1 and s[2] >= loaded_w]
        if not got:
            return "no samples under load"
        mhz = [s[1] for s in got]
        capped = sum(1 for s in got if s[3] & CAPPED)
        return (f"{len(got)} samples under load: SM {sum(mhz) / len(mhz):.0f} MHz (lowest {min(mhz)}), "
                f"{sum(s[2] for s in got) / len(got):.0f} W, {100 * capped / len(got):.0f}% capped by power")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval-ms", type=float, default=20.0, help="between readings (default 20)")
    p.add_argument("--loaded-w", type=float, default=300.0, help="a reading under load draws at least this "
                                                                 "(default 300 W: an H200 idles near 120)")
    p.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    p.add_argument("--every", type=float, default=None, metavar="S", help="also a reading of each S seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.interval_ms <= 0 or args.every is not None and args.every <= 0:
        p.error(f"--interval-ms {args.interval_ms}, --every {args.every}: each must be positive")
    try:
        sampler = Sampler(args.device, args.interval_ms / 1e3)
    except Exception as e:  # noqa: BLE001 -- no pynvml, no driver, no such GPU: one line
        print(f"power_draw: error: NVML: {e}", file=sys.stderr)
        return 1
    sampler.start()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    if args.every:
        start = time.monotonic()

        def tick():  # a reading of each period, while the command runs
            k = 0
            while child.poll() is None:
                k += 1
                time.sleep(max(0.0, start + k * args.every - time.monotonic()))
                t1 = start + k * args.every
                print(f"    [power {t1 - args.every - start:5.1f}-{t1 - start:5.1f} s] "
                      f"{sampler.since(t1 - args.every, t1, args.loaded_w)}", flush=True)

        threading.Thread(target=tick, daemon=True).start()
    last = time.monotonic()
    for line in child.stdout:
        now = time.monotonic()
        print(line.rstrip("\n"), flush=True)
        if now - last > 0.2:  # a line after work, not one of a burst
            print(f"    [power] {sampler.since(last, now, args.loaded_w)}", flush=True)
        last = now
    rc = child.wait()
    sampler.done.set()
    sampler.join()
    return rc


if __name__ == "__main__":
    sys.exit(main())
