"""One rank of a job that a launcher started (torchrun, SLURM, mpirun, rawgpu.launch), from the rendezvous to its end.

The ranks meet (rendezvous.py) and keep the connections as the job's links: rank 0 one to every rank, every other
rank one to rank 0. Over them go the parts of a checkpoint (`gather`: safetensors bytes, never a pickle) and how a
rank ends: BYE when it is done, STOP with a line when it fails or is interrupted. A link that closes without BYE is a
rank that died. Either way rank 0 passes the line on to every rank, and every rank prints it, aborts its NCCL
communicator (a collective waiting for a dead rank never returns) and exits: the job never hangs on a lost rank. NCCL's
asynchronous errors, polled while the communicator lives, end the job the same way. Files in the middle of being
written are removed first (files.py), so nothing is left half-written.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Iterator, NoReturn

import numpy as np

from ..runtime import files
from ..runtime.errors import RawgpuError
from . import rendezvous
from .launchers import World, tell_launcher

_FRAME = struct.Struct("!4sBQ")  # magic, kind, length of the payload that follows
_MAGIC = b"RGJL"
PART, STOP, BYE = 1, 2, 3
MAX_LINE_BYTES = 1024
POLL_SECONDS = 0.5  # how often NCCL's asynchronous error is read
ABORT_SECONDS = 3.0  # how long ncclCommAbort may take before the process exits regardless
FAILED, INTERRUPTED = 1, 130  # exit statuses of a rank the job's end reaches


class JobError(RawgpuError):
    """A rank's link broke the job's protocol (a malformed frame): one line naming the rank."""


def pack_part(value: tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]) -> bytes:
    """A rank's (parameters(), state()) as safetensors bytes: arrays and names only, nothing executable."""
    from safetensors.numpy import save

    weights, state = value
    arrays = {f"w.{i}": np.ascontiguousarray(w) for i, (w, _) in enumerate(weights)}
    arrays |= {f"b.{i}": np.ascontiguousarray(b) for i, (_, b) in enumerate(weights)}
    arrays |= {f"s.{key}": np.ascontiguousarray(v) for key, v in state.items()}
    return save(arrays)


def unpack_part(blob: bytes) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
    from safetensors.numpy import load

    arrays = load(blob)
    layers = sum(1 for key in arrays if key.startswith("w."))
    weights = [(arrays[f"w.{i}"], arrays[f"b.{i}"]) for i in range(layers)]
    return weights, {key[2:]: v for key, v in arrays.items() if key.startswith("s.")}


class Link:
    """The connection to one other rank. A thread reads its frames as they come: parts into a queue, STOP and a close
    without BYE to the job's end."""

    def __init__(self, job: "Job", peer: int, conn: socket.socket):
        self.job, self.peer, self.conn = job, peer, conn
        self.parts: queue.Queue[bytes] = queue.Queue()
        self.said_bye = False
        self._send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True, name=f"rawgpu-link-{peer}")

    def send(self, kind: int, payload: bytes = b"") -> None:
        with self._send_lock:
            self.conn.sendall(_FRAME.pack(_MAGIC, kind, len(payload)) + payload)

    def _recv(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.conn.recv(min(left, 1 << 24))
            if not chunk:
                raise ConnectionError("closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _read(self) -> None:
        try:
            while True:
                magic, kind, length = _FRAME.unpack(self._recv(_FRAME.size))
                if magic != _MAGIC or kind not in (PART, STOP, BYE) or (kind != PART and length > MAX_LINE_BYTES):
                    raise JobError(f"rank {self.peer} sent a malformed message")
                payload = self._recv(length)
                if kind == PART:
                    self.parts.put(payload)
                elif kind == STOP:
                    self.job.end(payload.decode(errors="replace"))
                else:
                    self.said_bye = True
        except JobError as exc:
            self._lost(str(exc))
        except (OSError, struct.error):  # ConnectionError is an OSError
            self._lost(f"rank {self.peer} of {self.job.world.size} ended without a word (it died or was killed)")

    def _lost(self, line: str) -> None:
        if not self.said_bye:
            self.job.end(line)


class Job:
    """This process's rank of a job and its links (rank 0: to every rank; others: to rank 0)."""

    def __init__(self, world: World, unique_id: bytes, links: dict[int, socket.socket], rendezvous_seconds: float):
        self.world, self.unique_id, self.rendezvous_seconds = world, unique_id, rendezvous_seconds
        self.links = {peer: Link(self, peer, conn) for peer, conn in links.items()}
        self._comm: Any = None
        self.exit = os._exit  # how the job's end leaves the process: at once, without unwinding (tests record it)
        self._state = "running"  # then "done" (BYE sent) or "ending" (the job's end is under way here)
        self._lock = threading.Lock()
        self.end_status: int | None = None  # the status the job's end leaves with, once it has begun
        self._ended = threading.Event()  # end() has come back from self.exit (only where tests record it)
        for link in self.links.values():
            link.thread.start()

    @property
    def name(self) -> str:
        return f"rank {self.world.rank} of {self.world.size}"

    # --- the job's work over the links ------------------------------------------------------------------------------

    def gather(self, value: Any) -> list[Any] | None:
        """ranks.gather_to_root over the links: rank 0 gets every rank's (parameters(), state()) in rank order, the
        others None."""
        if self.world.rank:
            self.links[0].send(PART, pack_part(value))
            return None
        return [value] + [unpack_part(self.links[r].parts.get()) for r in range(1, self.world.size)]

    def watch(self, comm: Any) -> None:
        """Poll the communicator's asynchronous error while it lives; one ends the job. The job aborts it at its end."""
        self._comm = comm

        def poll() -> None:
            while self._state == "running" and comm.alive:
                if (error := comm.async_error()) is not None:
                    self.end(f"NCCL reports {error} on {self.name}'s communicator (a rank or its network failed)")
                time.sleep(POLL_SECONDS)

        threading.Thread(target=poll, daemon=True, name="rawgpu-nccl-poll").start()

    # --- how this rank ends ---------------------------------------------------------------------------------------

    def finish(self) -> None:
        """This rank is done: BYE, so that its link closing is no failure."""
        with self._lock:
            if self._state != "running":
                return
            self._state = "done"
        for link in self.links.values():
            with contextlib.suppress(OSError):
                link.send(BYE)

    def end(self, line: str, status: int = FAILED, own: bool = False) -> None:
        """End the job from this rank: rank 0 passes the line on to every rank, another rank sends it to rank 0; then
        print it, abort the communicator and exit with `status`. own: the line is this rank's own failure (else it
        came from another rank). Only the first end counts; a rank already done ignores the others'."""
        with self._lock:
            if self._state != "running":
                return
            self._state = "ending"
            self.end_status = status
        for peer, link in self.links.items():
            if self.world.rank == 0 or peer == 0:
                with contextlib.suppress(OSError):
                    link.send(STOP, line.encode()[:MAX_LINE_BYTES])
        stopper = threading.Timer(ABORT_SECONDS, self.exit, (status,))
        stopper.daemon = True
        stopper.start()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        said = f"{self.name}: {'error: ' if status == FAILED else ''}{line}" + ("" if own else "; the job stopped")
        sys.stderr.write(f"rawgpu: {said}\n")  # one write: one line among the ranks'
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        files.remove_unfinished()
        tell_launcher(said)
        if self._comm is not None:
            with contextlib.suppress(Exception):
                self._comm.abort()
        stopper.cancel()
        self.exit(status)
        self._ended.set()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around the rank's whole run: an exception that escapes it, Ctrl-C or SIGTERM ends the job at once from
        here (the other ranks would otherwise wait in a collective for this one forever)."""
        def on_signal(signum: int, frame: Any) -> None:
            what = signal.Signals(signum).name
            self.end(f"{self.name} was stopped by {what}", 128 + signum, own=True)

        # SIGINT ignored stays ignored (a background job of a script), as in run_ranks' ranks
        stops = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN
                 and threading.current_thread() is threading.main_thread()]  # (ranks as threads: tests)
        handlers = {s: signal.signal(s, on_signal) for s in stops}
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - any failure of this rank is the job's end
            what = str(exc) if isinstance(exc, RawgpuError) else f"{type(exc).__name__}: {exc}"
            self.end(f"{self.name} failed: {what}", own=True)
            # Where the end was already under way in a link's thread (its abort is often what failed here), that
            # thread prints the line and leaves the process: wait for it rather than go on as if the run had ended.
            self._ended.wait(ABORT_SECONDS + 2)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)

    def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(OSError):
                link.conn.shutdown(socket.SHUT_RDWR)  # wakes its reading thread
            link.conn.close()


def fail(world: World, line: str) -> NoReturn:
    """End this rank before its job began (or without one): one line naming it, on stderr and where its launcher
    looks; exit 1."""
    if not line.startswith(f"rank {world.rank} of"):
        line = f"rank {world.rank} of {world.size}: {line}"
    print(f"rawgpu: error: {line}", file=sys.stderr, flush=True)
    tell_launcher(line)
    raise SystemExit(1)


class Meeting:
    """What this rank needs to meet the others, taken when the run starts so that it overlaps the data's loading and
    CUDA's start (start_meeting); meet() uses it. Rank 0's listening socket (a port in use is said at once), and
    under torchrun with its agent's store the child that writes rank 0's port there or reads it
    (torchrun_store.py). close() lets go of what meet() did not take."""

    def __init__(self, world: World, timeout: float):
        self.server, self.exchange, self._published = None, None, None
        if world.store_key is not None:
            from .torchrun_store import PortExchange

            self.exchange = PortExchange(world.master_host, world.master_port, world.store_key, timeout,
                                         publishing=world.rank == 0)
        if world.rank == 0:
            try:
                self.server = rendezvous.listen(world.master_host, 0 if self.exchange else world.master_port)
            except BaseException:
                self.close()
                raise
            if self.exchange is not None:  # written while the run goes on; meet() waits for it
                port, errors = self.server.getsockname()[1], []
                thread = threading.Thread(target=lambda: _capture(errors, self.exchange.publish, port), daemon=True)
                thread.start()
                self._published = (thread, errors)

    def port_of_rank_0(self, world: World) -> int:
        return self.exchange.lookup() if self.exchange is not None else world.master_port

    def wait_published(self) -> None:
        """Rank 0: its port is in torchrun's store (StoreError where it could not be written)."""
        if self._published is not None:
            thread, errors = self._published
            thread.join()
            if errors:
                raise errors[0]

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        if self.server is not None:
            self.server.close()


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for it
        errors.append(exc)


def start_meeting(world: World, timeout: float) -> Meeting:
    """This rank's Meeting, started now (see Meeting). RendezvousError: rank 0 cannot listen, in one line."""
    try:
        return Meeting(world, timeout)
    except rendezvous.RendezvousError as exc:
        raise rendezvous.RendezvousError(f"rank {world.rank} of {world.size}: {exc}") from None


def meeting_or_fail(world: World | None, timeout: float) -> Meeting | None:
    """For the CLIs: start_meeting, or fail() with its line; None for a process that is no rank of a job."""
    if world is None:
        return None
    try:
        return start_meeting(world, timeout)
    except rendezvous.RendezvousError as exc:
        fail(world, str(exc))


def meet(world: World, identity: rendezvous.Identity, timeout: float, log=print, meeting: Meeting | None = None,
         nccl: bool = True) -> Job:
    """The rendezvous of this rank (rank 0 serves NCCL's id at the master's address, the others fetch it), then the
    job with its links. meeting: start_meeting's (default: started here). nccl: False for a job that needs no
    communicator (a sweep's). RendezvousError: the ranks could not meet, in one line naming this rank, the address
    and the cause."""
    from .torchrun_store import StoreError

    token = os.environ.get(rendezvous.TOKEN_VARIABLE, "").encode()
    t = time.perf_counter()
    try:
        meeting = meeting if meeting is not None else Meeting(world, timeout)
        if world.rank == 0:
            if nccl:
                from ..runtime import nccl as nccl_module

                unique_id = nccl_module.new_unique_id()
            else:
                unique_id = bytes(rendezvous.UNIQUE_ID_BYTES)
            meeting.wait_published()
            server, meeting.server = meeting.server, None  # serve() closes it
            links = rendezvous.serve(world.master_host, server.getsockname()[1], world.size, identity, unique_id,
                                     timeout, token, log, server=server)
        else:
            unique_id, conn = rendezvous.join(world.master_host, meeting.port_of_rank_0(world), world.rank,
                                              world.size, identity, timeout, token)
            links = {0: conn}
    except (rendezvous.RendezvousError, StoreError) as exc:
        line = str(exc)
        raise rendezvous.RendezvousError(line if line.startswith(f"rank {world.rank} of")
                                         else f"rank {world.rank} of {world.size}: {line}") from None
    finally:
        if meeting is not None:
            meeting.close()
    return Job(world, unique_id, links, time.perf_counter() - t)
