"""Whether a run is held by the GPU's power limit: runs a command while GPU 0's NVML readings are taken
(benchmarks.power.PowerLog: SM clock, power, whether the power limit holds the clock) and after each line the command
prints, prints what the GPU did since the line before: the readings under load (power at least --loaded-w), their
mean and lowest SM clock, mean power and the share capped by power. A timed run that prints a line per system or
variant gets a reading each.

    PYTHONPATH=.:scripts:dev python dev/power_draw.py [--interval-ms 20] [--loaded-w 300] [--every S]
                                                      -- python3 dev/... ARGS

--every S also prints a reading of each S seconds, for a command that prints its lines only at the end.

A kernel that runs at the top clock (1980 MHz on the H200) beside one that runs capped at 700 W shows where energy,
not cycles, sets the time (docs/perf.md: Power). Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

from benchmarks.power import PowerLog, describe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval-ms", type=float, default=20.0, help="between readings (default 20)")
    p.add_argument("--loaded-w", type=float, default=300.0, help="a reading under load draws at least this "
                                                                 "(default 300 W: an H200 idles near 120)")
    p.add_argument("--every", type=float, default=None, metavar="S", help="also a reading of each S seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.interval_ms <= 0 or args.every is not None and args.every <= 0:
        p.error(f"--interval-ms {args.interval_ms}, --every {args.every}: each must be positive")
    log = PowerLog(interval=args.interval_ms / 1e3).start()
    loaded = lambda r: (r.power_w or 0) >= args.loaded_w  # noqa: E731
    reading = lambda t0, t1: describe(log.summary(t0, t1, loaded))  # noqa: E731
    try:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    except OSError as e:
        log.stop()
        print(f"power_draw: error: {command[0]}: {e.strerror}", file=sys.stderr)
        return 1
    if args.every:
        start = time.monotonic()

        def tick():  # a reading of each period, while the command runs
            k = 0
            while child.poll() is None:
                k += 1
                time.sleep(max(0.0, start + k * args.every - time.monotonic()))
                t1 = start + k * args.every
                print(f"    [power {t1 - args.every - start:5.1f}-{t1 - start:5.1f} s] {reading(t1 - args.every, t1)}",
                      flush=True)

        threading.Thread(target=tick, daemon=True).start()
    last = time.monotonic()
    for line in child.stdout:
        now = time.monotonic()
        print(line.rstrip("\n"), flush=True)
        if now - last > 0.2:  # a line after work, not one of a burst
            print(f"    [power] {reading(last, now)}", flush=True)
        last = now
    rc = child.wait()
    log.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
