"""Under torchrun, the ranks find rank 0's rendezvous port through the store torchrun already runs.

torchrun's agent keeps its own TCP store on MASTER_PORT and tells its workers so (TORCHELASTIC_USE_AGENT_STORE=True):
no rank may bind that port. So rank 0 listens on a port the system picks, at MASTER_ADDR (its own host, as torchrun
says), and writes the port into torchrun's store; every other rank reads it there and meets rank 0 as under any
other launcher. Nothing here runs where torchrun's variables are absent.

Two ways to the store, one owner (PortExchange):
- `WireStore`: torch's store protocol spoken here (VALIDATE, PING, SET, WAIT, GET: a few fixed binary messages), after
  a handshake that proves the server speaks it (the PING's nonce comes back). No import of torch: that import takes
  seconds, and torch's own CUDA libraries (its NCCL) would load into a rank that has its own.
- Where the handshake fails (a torch that changed its protocol), torch's own client in a child process: this module
  run as one, `python -m rawgpu.parallel.torchrun_store HOST PORT KEY TIMEOUT set|get`. It prints `ready` once it reaches the
  store; then `set` reads the value from its standard input and prints `done`, `get` prints the value once it is
  there; a failure is one line on its standard error, exit 1. This is the one place rawgpu imports torch, and only
  where torchrun started the process (torch is there whenever torchrun is).
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Mapping

AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
BACKSTOP_SECONDS = 20.0


def agent_store_key(env: Mapping[str, str]) -> str | None:
    """The key of this job's rendezvous port in torchrun's store, or None where no torchrun agent keeps a store for
    its workers (another launcher, or torchrun without one: then MASTER_PORT is free for rank 0). One key per run
    and restart, so a restarted job never reads its last attempt's port."""
    if env.get(AGENT_STORE_VARIABLE) != "True":
        return None
    return (f"rawgpu/{env.get('TORCHELASTIC_RUN_ID', 'none')}/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
            "rendezvous_port")


class StoreError(Exception):
    """torchrun's store could not be reached or did not answer in time: one line naming host:port."""


class ProtocolMismatch(Exception):
    """The store at host:port answered, but not as torch's store protocol that WireStore speaks."""


class WireStore:
    """A client of torch's TCP store (torch/csrc/distributed/c10d: TCPStore, its libuv server), the few queries the
    rendezvous needs. Values are the machine's byte order, as torch sends them; keys carry torch's '/' prefix, so
    torch's own client reads what this one writes."""

    VALIDATE, SET, GET, WAIT, PING = 0, 1, 3, 6, 13  # c10d::detail::QueryType
    MAGIC = 0x3C85F7CE  # c10d::detail::validationMagicNumber
    STOP_WAITING = 0  # c10d::detail::WaitResponseType
    HANDSHAKE_SECONDS = 5.0

    def __init__(self, host: str, port: int):
        self.where = f"{host}:{port}"
        try:
            self.conn = socket.create_connection((host, port), timeout=self.HANDSHAKE_SECONDS)
        except OSError as exc:
            raise StoreError(f"torchrun's store at {self.where} cannot be reached: {exc.strerror or exc}") from None
        try:
            nonce = os.getpid() & 0xFFFFFFFF
            self.conn.sendall(struct.pack("=BI", self.VALIDATE, self.MAGIC) + struct.pack("=BI", self.PING, nonce))
            if struct.unpack("=I", self._recv(4))[0] != nonce:
                raise ProtocolMismatch("the ping's nonce did not come back")
        except (OSError, ProtocolMismatch) as exc:
            self.conn.close()
            raise ProtocolMismatch(f"{self.where}: {exc}") from None

    @staticmethod
    def _text(data: bytes) -> bytes:
        return struct.pack("=Q", len(data)) + data

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.conn.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the store closed the connection")
            data += chunk
        return data

    def set(self, key: str, value: bytes) -> None:
        self.conn.sendall(struct.pack("=B", self.SET) + self._text(b"/" + key.encode()) + self._text(value))

    def get(self, key: str, timeout: float) -> bytes:
        """The value once some client has set it; StoreError after `timeout` seconds."""
        name = b"/" + key.encode()
        try:
            self.conn.settimeout(timeout)
            self.conn.sendall(struct.pack("=BQ", self.WAIT, 1) + self._text(name))
            if self._recv(1) != bytes([self.STOP_WAITING]):
                raise StoreError(f"torchrun's store at {self.where} gave up waiting for rank 0's port")
            self.conn.sendall(struct.pack("=B", self.GET) + self._text(name))
            (n,) = struct.unpack("=Q", self._recv(8))
            return self._recv(n)
        except TimeoutError:
            raise StoreError(f"torchrun's store at {self.where}: no rendezvous port from rank 0 in {timeout:g} s")\
                from None
        except OSError as exc:
            raise StoreError(f"torchrun's store at {self.where}: {exc.strerror or exc}") from None

    def close(self) -> None:
        self.conn.close()


class PortExchange:
    """This rank's way to rank 0's port in torchrun's store at host:port: rank 0 `publish`es it, every other rank
    `lookup`s it. Start it early. Through WireStore where the store speaks its protocol; otherwise through torch's own
    client in a child process, which gives up after `timeout` seconds and says why (this side waits BACKSTOP_SECONDS
    longer for that line, torch's import counted, before it gives up itself). An unreachable store is said when the
    port is asked for."""

    def __init__(self, host: str, port: int, key: str, timeout: float, publishing: bool):
        self.where, self.key, self.timeout = f"{host}:{port}", key, timeout
        self._wire: WireStore | None = None
        self._child: subprocess.Popen | None = None
        self._error: StoreError | None = None
        try:
            self._wire = WireStore(host, port)
        except StoreError as exc:
            self._error = exc
        except ProtocolMismatch:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, host, str(port), key, f"{timeout:g}", "set" if publishing else "get"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._lines: queue.Queue[str | None] = queue.Queue()
            self._reader = threading.Thread(target=self._read_lines, daemon=True, name="rawgpu-store-child")
            self._reader.start()

    @property
    def way(self) -> str:
        """How this rank reaches the store, for the run's header."""
        return "torch's client" if self._child is not None else "its protocol"

    def _line(self, deadline: float) -> str:
        """The child's next line on stdout; StoreError with its own line when it fails or says nothing in time. Read
        through the queue _read_lines fills: two lines that came together both count (a select on the pipe would not
        see the second, already in the reader's buffer)."""
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.close()
            raise StoreError(f"torchrun's store at {self.where}: its process said nothing in "
                             f"{self.timeout + BACKSTOP_SECONDS:g} s") from None
        if line is None:
            self._child.wait()
            why = self._child.stderr.read().strip().splitlines()
            raise StoreError(why[-1] if why else f"the store's process exited with status {self._child.returncode}")
        return line

    def _read_lines(self) -> None:
        for line in self._child.stdout:
            if line.strip():
                self._lines.put(line.strip())
        self._lines.put(None)  # the child's end

    def publish(self, port: int) -> None:
        """Rank 0: write its rendezvous port into the store; returns once it is there."""
        if self._error is not None:
            raise self._error
        if self._wire is not None:
            try:
                self._wire.set(self.key, str(port).encode())
            except OSError as exc:
                raise StoreError(f"torchrun's store at {self.where}: {exc.strerror or exc}") from None
            return
        deadline = time.monotonic() + self.timeout + BACKSTOP_SECONDS
        self._line(deadline)  # ready: connected
        self._child.stdin.write(f"{port}\n")
        self._child.stdin.flush()
        self._line(deadline)  # done
        self.close()

    def lookup(self) -> int:
        """Rank 1..: rank 0's rendezvous port, once rank 0 has written it (StoreError after the timeout)."""
        if self._error is not None:
            raise self._error
        if self._wire is not None:
            text = self._wire.get(self.key, self.timeout).decode(errors="replace")
        else:
            deadline = time.monotonic() + self.timeout + BACKSTOP_SECONDS
            self._line(deadline)  # ready
            text = self._line(deadline)
        self.close()
        if not text.isdigit() or not 1 <= int(text) <= 65535:
            raise StoreError(f"torchrun's store at {self.where} holds {text!r}, not a port")
        return int(text)

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._child is not None:
            if self._child.poll() is None:
                self._child.kill()
            self._child.wait()
            self._reader.join(1.0)  # the child's end closed its stdout: the reader is done with it
            for stream in (self._child.stdin, self._child.stdout, self._child.stderr):
                stream.close()


def _child(host: str, port: int, key: str, timeout: float, op: str, stdin: IO[str]) -> int:
    """The child's work: reach the store, then set or get `key`."""
    from datetime import timedelta

    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        print(f"torchrun's store at {host}:{port} needs torch, which this Python lacks ({exc})", file=sys.stderr)
        return 1
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; the line says which
        print(f"torchrun's store at {host}:{port} cannot be reached: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    try:
        if op == "set":
            value = stdin.readline().strip()
            if not value:  # the rank ended before it listened: nothing to publish
                return 1
            store.set(key, value)
            print("done", flush=True)
        else:
            # the rank's end closes this pipe: a child left waiting for rank 0 would outlive it otherwise
            threading.Thread(target=lambda: (stdin.read(), os._exit(1)), daemon=True).start()
            print(store.get(key).decode(), flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"torchrun's store at {host}:{port}: no rendezvous port from rank 0 in {timeout:g} s "
              f"({str(exc).splitlines()[0]})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    _host, _port, _key, _timeout, _op = sys.argv[1:6]
    sys.exit(_child(_host, int(_port), _key, float(_timeout), _op, sys.stdin))
