"""One host's ranks of a job: each a fork of this process with a launcher's variables, supervised to their end.

rawgpu.launch and `--gpus N` start ranks here (`start`, `run`): each rank is a fork of the launching process
(`ForkedRank`), taken after it has imported the CLI the ranks run and before it starts CUDA, NCCL or a thread, so no
rank pays Python's start and the imports again. The launcher's own checks that load a library (NVML's GPU count,
NCCL's presence) run in a fork of their own (`in_fork`): NCCL's state does not survive a fork. After a failure the
other ranks get GRACE_SECONDS to end themselves (the job ends them: job.py) and are then killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Callable

POLL_SECONDS = 0.1
GRACE_SECONDS = 15.0  # after a rank fails, how long the others get to end before they are killed
LAUNCHER_VARIABLE = "RAWGPU_LAUNCHER"  # who started the ranks, for their header (launchers.py reads it)


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


def start(main: Callable[[list[str]], int | None], args: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
          master: tuple[str, int] = ("127.0.0.1", 0), launcher: str = "rawgpu.launch") -> list["ForkedRank"]:
    """This host's `nproc` ranks, each main(ARGS) (a CLI's main: rawgpu.train's, rawgpu.sweep's) with its variables,
    forked from this process, which has imported that CLI already (so the ranks skip Python's start and the
    imports). A master port 0: a free one (one host)."""

    if master[1] == 0:
        master = (master[0], free_port(master[0]))
    procs = []
    try:
        for local in range(nproc):
            env = {**rank_environment(nnodes, node_rank, master, nproc, local), LAUNCHER_VARIABLE: launcher}
            procs.append(ForkedRank(lambda: main(list(args)), env))
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
