"""Run N copies of a command at once (or one after another) on one GPU, each under a hard time limit.

    python dev/concurrency/many.py --procs 4 [--timeout 60] [--serial] [--label NAME] -- COMMAND ARGS...

`{i}` in the command's arguments becomes the copy's index (a seed, a file name). Every copy runs in a process
group of its own; at the limit the group gets SIGTERM, then SIGKILL 3 s later, and a copy still alive 5 s after
that is reported as stuck in the driver (its /proc state). Prints one line per copy (exit status, wall seconds,
the training time of a `rawgpu.train` run when its summary shows one) and one summary line:

    many NAME: N=4 all finished; wall 1.23 s; training 0.25 s summed (0.06 s mean); exit 0

Exit status: 0 every copy exited 0; 1 some copy failed; 3 some copy hit the limit; 4 some copy survived SIGKILL.
Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

TRAINED = re.compile(r"trained \d+ steps in ([0-9.]+) s")


@dataclass
class Copy:
    index: int
    proc: subprocess.Popen
    started: float
    ended: float | None = None
    timed_out: bool = False
    stuck: str = ""


def proc_state(pid: int) -> str:
    """The kernel's state letter of a process (D: uninterruptible, in the driver), or '' once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def start(index: int, command: list[str], env: dict[str, str]) -> Copy:
    argv = [a.replace("{i}", str(index)) for a in command]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    return Copy(index, proc, time.monotonic())


def signal_group(copy: Copy, sig: int) -> None:
    try:
        os.killpg(copy.proc.pid, sig)
    except ProcessLookupError:
        pass


def finish(copies: list[Copy], timeout: float) -> None:
    """Wait for every copy up to `timeout` s from its start; then TERM, KILL, and note the ones that stay."""
    while True:
        now = time.monotonic()
        live = [c for c in copies if c.ended is None]
        for c in live:
            if c.proc.poll() is not None:
                c.ended = now
            elif now - c.started > timeout:
                c.timed_out = True
        live = [c for c in copies if c.ended is None]
        if not live or all(c.timed_out for c in live):
            break
        time.sleep(0.01)
    late = [c for c in copies if c.ended is None]
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for c in late:
            signal_group(c, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(c.proc.poll() is None for c in late):
            time.sleep(0.05)
        late = [c for c in late if c.proc.poll() is None]
    for c in late:
        c.stuck = proc_state(c.proc.pid) or "?"


def output_of(copy: Copy) -> str:
    if copy.stuck:  # its pipe may never close
        return ""
    try:
        out, _ = copy.proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return ""
    return out or ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds each copy may run")
    p.add_argument("--serial", action="store_true", help="one after another (the baseline), not all at once")
    p.add_argument("--label", default="")
    p.add_argument("--verbose", action="store_true", help="print every copy's output")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if shutil.which(command[0]) is None:
        p.error(f"no program {command[0]!r} to run")
    t0 = time.monotonic()
    copies: list[Copy] = []
    if args.serial:
        for i in range(args.procs):
            copies.append(start(i, command, env))
            finish(copies[-1:], args.timeout)
            if copies[-1].timed_out:
                break
    else:
        copies = [start(i, command, env) for i in range(args.procs)]
        finish(copies, args.timeout)
    wall = time.monotonic() - t0
    trained, failed = [], 0
    for c in copies:
        out = output_of(c)
        rc = c.proc.returncode
        m = TRAINED.findall(out)
        if m:
            trained.append(float(m[-1]))
        state = (f"STUCK in state {c.stuck} after SIGKILL" if c.stuck else
                 f"TIMED OUT after {args.timeout:.0f} s" if c.timed_out else f"exit {rc}")
        failed += bool(c.stuck or c.timed_out or rc)
        took = (c.ended or time.monotonic()) - c.started
        last = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"  copy {c.index}: {state}, {took:.2f} s; {last[:160]}")
        if args.verbose and out:
            print("    " + out.strip().replace("\n", "\n    "))
    hung = [c for c in copies if c.timed_out]
    stuck = [c for c in copies if c.stuck]
    verdict = (f"{len(stuck)} STUCK" if stuck else f"{len(hung)} HUNG" if hung else
               "all finished" if not failed else f"{failed} failed")
    times = f"; training {sum(trained):.2f} s summed ({sum(trained) / len(trained):.2f} s mean)" if trained else ""
    code = 4 if stuck else 3 if hung else 1 if failed else 0
    how = "one after another" if args.serial else "at once"
    print(f"many {args.label}: N={args.procs} {how}: {verdict}; wall {wall:.2f} s{times}; exit {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
