"""The ranks of a job on several hosts meet before any GPU work: rank 0 serves NCCL's unique id over TCP at the
master's address, every other rank fetches it, and all of them agree on the world size and on what they run.

A rank says who it is in one fixed binary message (HELLO: magic, version, rank, world size, three digests: the
recipe's, the dataset's and rawgpu's version, and the shared token's length and bytes); nothing received is ever
unpickled, and a message is read only up to its fixed size. Rank 0 answers once every rank has arrived: the unique id,
or one line that names the rank that differs (or the ranks that never came) and ends the job everywhere. Whatever
else connects (a stranger, a malformed or oversized message, a wrong token, a rank that came twice) is refused with
one line to `log` while the job goes on waiting for its real ranks. The token (RAWGPU_RENDEZVOUS_TOKEN) is compared
in constant time.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

from ..runtime.errors import RawgpuError
from ..runtime.nccl import UNIQUE_ID_BYTES

MAGIC = b"RAWGPURV"
VERSION = 1
DIGEST_BYTES = 32
MAX_TOKEN_BYTES = 256
MAX_ANSWER_TEXT = 1024
_HELLO = struct.Struct(f"!8sHII{3 * DIGEST_BYTES}sH")  # then token_len bytes of token
_ANSWER = struct.Struct("!8sBH")  # magic, ok, length of what follows: the unique id, or the error's text
TOKEN_VARIABLE = "RAWGPU_RENDEZVOUS_TOKEN"
PEER_SECONDS = 5.0  # how long a connection may take to say hello before it is dropped
RETRY_SECONDS = 0.2  # how often a rank tries to reach rank 0 again while it is not listening yet


class RendezvousError(RawgpuError):
    """The ranks could not meet: one line naming the rank that differs or the ranks that did not arrive."""


@dataclass(frozen=True)
class Identity:
    """What every rank must agree on, as digests: the recipe, the dataset, rawgpu's version."""

    recipe: bytes
    dataset: bytes
    version: bytes

    @classmethod
    def of(cls, recipe: str, dataset: str, version: str) -> "Identity":
        digest = lambda text: hashlib.sha256(text.encode()).digest()  # noqa: E731
        return cls(digest(recipe), digest(dataset), digest(version))

    def differs_in(self, other: "Identity") -> str | None:
        """What `other` has another of ('recipe', 'dataset', 'rawgpu version'), or None."""
        for what, mine, theirs in (("recipe", self.recipe, other.recipe), ("dataset", self.dataset, other.dataset),
                                   ("rawgpu version", self.version, other.version)):
            if mine != theirs:
                return what
        return None


def hello(rank: int, size: int, identity: Identity, token: bytes = b"") -> bytes:
    """A rank's message to rank 0."""
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(f"${TOKEN_VARIABLE}: at most {MAX_TOKEN_BYTES} bytes, got {len(token)}")
    digests = identity.recipe + identity.dataset + identity.version
    return _HELLO.pack(MAGIC, VERSION, rank, size, digests, len(token)) + token


def _recv_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed early")
        data += chunk
    return data


def _read_hello(conn: socket.socket, token: bytes) -> tuple[int, int, Identity]:
    """(rank, size, identity) of a peer's hello; ValueError saying what is wrong with it."""
    deadline = time.monotonic() + PEER_SECONDS
    head = _recv_exactly(conn, _HELLO.size, deadline)
    magic, version, rank, size, digests, token_len = _HELLO.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ValueError("not a rawgpu rank (wrong magic or version)")
    if token_len > MAX_TOKEN_BYTES:
        raise ValueError(f"a token of {token_len} bytes (at most {MAX_TOKEN_BYTES})")
    theirs = _recv_exactly(conn, token_len, deadline) if token_len else b""
    if not hmac.compare_digest(theirs, token):
        raise _Refused(f"a wrong token (${TOKEN_VARIABLE} differs from rank 0's)")
    d = DIGEST_BYTES
    return rank, size, Identity(digests[:d], digests[d:2 * d], digests[2 * d:])


class _Refused(ValueError):
    """A rawgpu rank's hello that rank 0 refuses, telling it why (a wrong token)."""


def _refuse(conn: socket.socket, addr: tuple, why: str, log: Callable[[str], None]) -> None:
    """Log the refusal, tell the peer why, and go on waiting for the job's ranks."""
    log(f"rendezvous: refused {addr[0]}:{addr[1]}: {why}")
    _answer(conn, False, f"rendezvous: rank 0 refused this rank: {why}".encode()[:MAX_ANSWER_TEXT])
    conn.close()


def _answer(conn: socket.socket, ok: bool, payload: bytes) -> None:
    try:
        conn.sendall(_ANSWER.pack(MAGIC, int(ok), len(payload)) + payload)
    except OSError:
        pass  # a rank gone already learns nothing more from us


def listen(host: str, port: int) -> socket.socket:
    """Rank 0's listening socket at host:port (0: a port the system picks), taken as early as the run can: the ranks
    that come before rank 0 serves wait in its backlog, and a port in use is said at once. RendezvousError: one line
    with the address and the cause."""
    try:
        return socket.create_server((host, port), reuse_port=False, backlog=128)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)  # create_server adds the address to strerror
        hint = ("another program holds it: give the job another port" if exc.errno == errno.EADDRINUSE else
                "is the master's address one of this host's?")
        raise RendezvousError(f"rendezvous: rank 0 cannot listen at {host}:{port}: {why} ({hint})") from None


def serve(host: str, port: int, size: int, identity: Identity, unique_id: bytes, timeout: float,
          token: bytes = b"", log: Callable[[str], None] = print,
          ready: Callable[[int], None] | None = None, server: socket.socket | None = None) -> dict[int, socket.socket]:
    """Rank 0: listen on host:port (or on `server`, listen()'s socket) until ranks 1..size-1 have said hello, then
    hand each the unique id and return their connections, open (the job's links: jobs/job.py); or tell every rank
    that came what is wrong and raise RendezvousError with it (a rank that differs, ranks that did not arrive in
    `timeout` seconds). ready(port): called once listening (the port the system chose where port is 0)."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"a unique id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    waiting: dict[int, socket.socket] = {}
    problem: str | None = None
    deadline = time.monotonic() + timeout
    server = server if server is not None else listen(host, port)
    with server:
        port = server.getsockname()[1]
        if ready is not None:
            ready(port)
        try:
            while len(waiting) < size - 1 and problem is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(1, size) if r not in waiting]
                    problem = (f"rendezvous: rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {size} "
                               f"did not arrive at {host}:{port} in {timeout:g} s")
                    break
                server.settimeout(left)
                try:
                    conn, addr = server.accept()
                except TimeoutError:
                    continue
                try:
                    rank, their_size, theirs = _read_hello(conn, token)
                except _Refused as exc:  # a rawgpu rank, told why, so that it ends with the reason
                    _refuse(conn, addr, str(exc), log)
                    continue
                except (ValueError, ConnectionError, OSError, struct.error) as exc:
                    log(f"rendezvous: refused {addr[0]}:{addr[1]}: {exc}")
                    conn.close()
                    continue
                if their_size != size:
                    problem = f"rendezvous: rank {rank} says the job has {their_size} ranks, rank 0 says {size}"
                elif not 1 <= rank < size:
                    _refuse(conn, addr, f"rank {rank} is not one of 1..{size - 1}", log)
                    continue
                elif rank in waiting:
                    _refuse(conn, addr, f"rank {rank} came already", log)
                    continue
                elif (what := identity.differs_in(theirs)) is not None:
                    problem = f"rendezvous: rank {rank} has another {what} than rank 0"
                waiting[rank] = conn
            for conn in waiting.values():
                _answer(conn, problem is None, unique_id if problem is None else problem.encode()[:MAX_ANSWER_TEXT])
        except BaseException:
            problem = problem or "interrupted"
            raise
        finally:
            if problem is not None:
                for conn in waiting.values():
                    conn.close()
    if problem is not None:
        raise RendezvousError(problem)
    for conn in waiting.values():
        conn.settimeout(None)
    return waiting


def join(host: str, port: int, rank: int, size: int, identity: Identity, timeout: float,
         token: bytes = b"") -> tuple[bytes, socket.socket]:
    """Rank 1..size-1: reach rank 0 (trying again until `timeout` while it is not listening yet), say hello and wait
    for the unique id; (the id, the connection, open: this rank's link to rank 0). RendezvousError with rank 0's line
    if the job cannot start."""
    deadline = time.monotonic() + timeout
    message = hello(rank, size, identity, token)
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
            break
        except socket.gaierror as exc:  # no such host: waiting would not help
            raise RendezvousError(f"rendezvous: rank 0's host {host!r} is not known here "
                                  f"({exc.strerror or exc})") from None
        except OSError as exc:
            if time.monotonic() + RETRY_SECONDS >= deadline:
                raise RendezvousError(f"rendezvous: could not reach rank 0 at {host}:{port} in "
                                      f"{timeout:g} s ({exc.strerror or exc})") from None
            time.sleep(RETRY_SECONDS)
    try:
        try:
            conn.sendall(message)
            magic, ok, length = _ANSWER.unpack(_recv_exactly(conn, _ANSWER.size, deadline))
            if magic != MAGIC or length > max(UNIQUE_ID_BYTES, MAX_ANSWER_TEXT):
                raise RendezvousError(f"rendezvous: {host}:{port} is not a rawgpu rank 0")
            payload = _recv_exactly(conn, length, deadline) if length else b""
        except (ConnectionError, OSError) as exc:
            raise RendezvousError(f"rendezvous: rank 0 at {host}:{port} ended the connection ({exc}); "
                                  "its own output says why") from None
        if not ok:
            raise RendezvousError(payload.decode(errors="replace"))
        if len(payload) != UNIQUE_ID_BYTES:
            raise RendezvousError(f"rendezvous: rank 0 sent a unique id of {len(payload)} bytes, not {UNIQUE_ID_BYTES}")
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return payload, conn
