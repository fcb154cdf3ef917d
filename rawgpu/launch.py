"""`python -m rawgpu.launch`: start the ranks of one host of a job on several (the part torchrun plays, without it).

    python -m rawgpu.launch --nnodes 2 --node-rank 0 --master-addr node0:29500 --nproc-per-node 4 -- --hidden 8192
    python -m rawgpu.launch --command sweep ... -- --lr 0.01 0.02 0.05 0.1 --seeds 0-15 --out sweep

Run it once on each host, with that host's --node-rank: it starts --nproc-per-node processes of `rawgpu.train`
(or `rawgpu.sweep`: --command; the arguments after --), each with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
so each is one rank on GPU LOCAL_RANK of this host; they meet at the master's address (rank 0 is local rank 0 of
node 0). The job ends itself when a rank fails (parallel/job.py); this launcher then waits for its ranks and exits
with the first failure's status. Ctrl-C reaches every rank of this host, which ends the job on every host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, Callable

from .cli import add_version_option, count, program

POLL_SECONDS = 0.1
GRACE_SECONDS = 15.0  # after a rank fails, how long the others get to end before they are killed
LAUNCHER_VARIABLE = "RAWGPU_LAUNCHER"  # who started the ranks, for their header (launchers.py reads it)


def address(text: str) -> tuple[str, int]:
    """An argparse type: HOST:PORT (a port 1..65535)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1..65535, got {text!r}")
    return host.strip("[]"), int(port)  # [::1]:29500 names an IPv6 host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program("launch"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when every local rank ended well, else the first failed rank's status; 2 bad "
               "arguments.")
    p.add_argument("--nnodes", type=count(1, 4096, what="hosts"), default=1, help="hosts in the job (default 1)")
    p.add_argument("--node-rank", type=count(0, what="index"), default=0,
                   help="this host's index, 0..nnodes-1 (default 0); node 0 holds rank 0")
    p.add_argument("--master-addr", type=address, default=("127.0.0.1", 29500), metavar="HOST:PORT",
                   help="node 0's address every host reaches, and a free port there (default 127.0.0.1:29500, "
                        "one host)")
    p.add_argument("--nproc-per-node", type=count(1, 64, what="processes"), required=True, metavar="G",
                   help="ranks on this host, one per GPU: GPUs 0..G-1 of those CUDA_VISIBLE_DEVICES shows")
    p.add_argument("--command", choices=COMMANDS, default="train",
                   help="what every rank runs: python -m rawgpu.train (default) or rawgpu.sweep (each rank trains its "
                        "share of the grid; rank 0 writes the results)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="the arguments of that command, after --")
    add_version_option(p)
    return p


COMMANDS = ("train", "sweep")


def command_main(command: str):
    """The module whose main() a rank runs."""
    from importlib import import_module

    return import_module(f".{command}", __package__)


def rank_environment(nnodes: int, node_rank: int, master: tuple[str, int], nproc: int, local: int) -> dict[str, str]:
    """Local rank `local`'s variables, as torchrun sets them."""
    host, port = master
    return {"RANK": str(node_rank * nproc + local), "WORLD_SIZE": str(nnodes * nproc), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": host, "MASTER_PORT": str(port)}


def visible_gpus() -> int | None:
    """How many GPUs this host's processes see, from NVML and CUDA_VISIBLE_DEVICES, without starting CUDA (slow,
    and the ranks start it themselves); None where NVML cannot tell."""
    try:
        count = in_fork(_nvml_gpus)
    except RuntimeError:  # the check's process died inside NVML: the ranks find out themselves
        return None
    if count is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def _nvml_gpus() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: the ranks find out themselves
        return None


def in_fork(check: Callable[[], Any]) -> Any:
    """check()'s result (None, or JSON), computed in a fork of this process: what a check loads (NVML, NCCL) stays
    out of the process that forks the ranks next (NCCL's state does not survive a fork: the ranks would crash in
    ncclCommInitRank). An exception in the check comes back as RuntimeError with its text."""
    _flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = {"value": check()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            with os.fdopen(write, "w") as out:
                json.dump(answer, out)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    os.waitpid(pid, 0)
    answer = json.loads(text) if text else {"error": "the check's process died"}
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer["value"]


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def start(train_args: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
          master: tuple[str, int] = ("127.0.0.1", 0), launcher: str = "rawgpu.launch",
          command: str = "train") -> list["ForkedRank"]:
    """This host's `nproc` ranks, each `rawgpu.<command> TRAIN_ARGS` with its variables, forked from this process
    once it has imported that command (so the ranks skip Python's start and the imports). A master port 0: a free
    one (one host)."""
    program = command_main(command)

    if master[1] == 0:
        master = (master[0], free_port(master[0]))
    procs = []
    try:
        for local in range(nproc):
            env = {**rank_environment(nnodes, node_rank, master, nproc, local), LAUNCHER_VARIABLE: launcher}
            procs.append(ForkedRank(lambda: program.main(list(train_args)), env))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


class ForkedRank:
    """One rank, a fork of this process that runs `main` with `env` added to its environment and exits with its
    status; poll/send_signal/kill/returncode as subprocess.Popen has them, for `supervise`. The fork comes before
    this process starts CUDA or any thread (CUDA does not survive a fork)."""

    def __init__(self, main: Callable[[], int | None], env: dict[str, str]):
        _flush()  # nothing buffered here is printed twice
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            self._child(main, env)

    @staticmethod
    def _child(main: Callable[[], int | None], env: dict[str, str]) -> None:
        status = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handlers pass signals on: not ours
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ.update(env)
            status = main() or 0
        except SystemExit as exc:  # argparse's errors; a message is printed as Python prints it at exit
            status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except KeyboardInterrupt:
            status = 130
        except BaseException:  # noqa: BLE001 - a rank must never return into the launcher's code
            import traceback

            traceback.print_exc()
        finally:
            try:
                _flush()
            finally:
                os._exit(status)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, wait_status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(wait_status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def supervise(procs: list, first_rank: int, quiet: bool = False, name: str = "rawgpu.launch") -> int:
    """Wait for every local rank; after the first failure give the rest GRACE_SECONDS to end (the job ends them),
    then kill what is left. The first failure's status (said in a line unless quiet), or 0."""
    failed: tuple[int, int] | None = None
    deadline = None
    while [p.poll() for p in procs].count(None):
        for local, p in enumerate(procs):
            if failed is None and p.returncode not in (None, 0):
                failed = (first_rank + local, p.returncode)
                deadline = time.monotonic() + GRACE_SECONDS
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(POLL_SECONDS)
    if failed is None:
        failed = next(((first_rank + i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if failed is None:
        return 0
    rank, status = failed
    if quiet:
        return status
    how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
    print(f"{name}: rank {rank} {how}", file=sys.stderr, flush=True)
    return 128 - status if status < 0 else status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.node_rank >= args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} is not below --nnodes {args.nnodes}")
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    for banned in ("--gpus", "--device"):
        if any(a == banned or a.startswith(banned + "=") for a in train_args):
            parser.error(f"{banned} is not for the ranks: each rank takes GPU LOCAL_RANK; --nproc-per-node sets "
                         "how many")
    command_main(args.command).build_parser().parse_args(train_args)  # a bad argument: one line here, not per rank
    if (gpus := visible_gpus()) is not None and args.nproc_per_node > gpus:
        parser.error(f"argument --nproc-per-node: {args.nproc_per_node} ranks, this host has {gpus} GPUs")
    return run(lambda: start(train_args, args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr,
                             command=args.command),
               args.node_rank * args.nproc_per_node, "rawgpu.launch: interrupted: every rank of this host stopped")


def run(start_ranks, first_rank: int, interrupted: str, name: str = "rawgpu.launch") -> int:
    """Start this host's ranks and supervise them to their end; the first failure's status. Ctrl-C reaches the ranks
    from the terminal too, and they end the job: wait for them, then say `interrupted`; 130. SIGTERM is passed on."""
    procs: list[ForkedRank] = []

    def pass_on(signum, frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        procs += start_ranks()
        return supervise(procs, first_rank, name=name)
    except KeyboardInterrupt:
        try:
            supervise(procs, first_rank, quiet=True)
        except KeyboardInterrupt:
            for p in procs:
                p.kill()
        print(interrupted, file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
