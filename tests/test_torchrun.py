"""Under torchrun (issue 62): torchrun's agent holds MASTER_PORT with its own store, so rank 0 listens on a port the
system picks and hands it to the others through that store (jobs/torchrun_store.py); a rank that fails leaves its
line in torchrun's error file. On the CPU, torch's store is a stand-in on files (torch is not installed here); the
real torchrun runs in tests/test_jobs_gpu.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from rawgpu.jobs import job as job_module
from rawgpu.jobs import rendezvous as rv
from rawgpu.jobs.launchers import World, tell_launcher, world_from_environment
from rank_threads import run_ranks
from rawgpu.jobs.torchrun_store import PortExchange, StoreError, agent_store_key

SAME = rv.Identity.of("recipe", "data", "0.1")

FAKE_TORCH = '''
import os, time
class TCPStore:
    """torch.distributed.TCPStore's client, on files: port 1 is a store nobody runs."""
    def __init__(self, host, port, is_master=False, timeout=None, wait_for_workers=True):
        if port == 1:
            raise RuntimeError("The client socket has failed to connect to [localhost]:1 (errno: 111 - Connection "
                               "refused).\\nmore lines")
        self.dir, self.timeout = os.environ["FAKE_STORE"], timeout.total_seconds()
    def _path(self, key):
        return os.path.join(self.dir, key.replace("/", "_"))
    def set(self, key, value):
        with open(self._path(key) + ".tmp", "w") as f:
            f.write(value)
        os.replace(self._path(key) + ".tmp", self._path(key))
    def get(self, key):
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(self._path(key)):
            if time.monotonic() > deadline:
                raise RuntimeError("Wait timeout")
            time.sleep(0.02)
        return open(self._path(key), "rb").read()
'''


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    package = tmp_path / "site" / "torch" / "distributed"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(FAKE_TORCH)
    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_STORE", str(store))
    return store


class StoreServer:
    """A stand-in for torchrun's agent store on localhost: torch's protocol for the queries WireStore sends (speaks=
    True), or a server that hangs up at once (speaks=False: another protocol, which sends a rank to torch's client).
    Keys are kept as sent."""

    def __init__(self, speaks: bool = True):
        import socket
        import struct

        self.values: dict[bytes, bytes] = {}
        self.changed = threading.Condition()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.speaks, self.struct = speaks, struct
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if not self.speaks:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        st = self.struct

        def recv(n):
            data = b""
            while len(data) < n:
                chunk = conn.recv(n - len(data))
                if not chunk:
                    raise ConnectionError
                data += chunk
            return data

        def text():
            return recv(st.unpack("=Q", recv(8))[0])

        try:
            while True:
                (query,) = recv(1)
                if query == 0:
                    assert st.unpack("=I", recv(4))[0] == 0x3C85F7CE
                elif query == 13:
                    conn.sendall(recv(4))
                elif query == 1:
                    key, value = text(), text()
                    with self.changed:
                        self.values[key] = value
                        self.changed.notify_all()
                elif query == 6:
                    keys = [text() for _ in range(st.unpack("=Q", recv(8))[0])]
                    with self.changed:
                        self.changed.wait_for(lambda: all(k in self.values for k in keys))
                    conn.sendall(b"\0")
                elif query == 3:
                    value = self.values[text()]
                    conn.sendall(st.pack("=Q", len(value)) + value)
                else:
                    return
        except (ConnectionError, OSError):
            return

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def store():
    server = StoreServer()
    yield server
    server.close()


TORCHRUN = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="abc", TORCHELASTIC_RESTART_COUNT="2")


def test_torchruns_agent_store_is_recognised_and_each_restart_has_its_own_key():
    world = world_from_environment(TORCHRUN)
    assert world.store_key == "rawgpu/abc/attempt_2/rendezvous_port" == agent_store_key(TORCHRUN)
    assert world_from_environment({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}).store_key is None
    assert world_from_environment({k: v for k, v in TORCHRUN.items() if "ELASTIC" not in k}).store_key is None


def test_rank_0_publishes_its_port_over_the_stores_protocol_and_the_others_find_it(store):
    lookup = PortExchange("127.0.0.1", store.port, "k", 10.0, publishing=False)
    assert lookup.way == "its protocol"
    found: list[int] = []
    waiting = threading.Thread(target=lambda: found.append(lookup.lookup()))
    waiting.start()  # waits in the store for the key
    PortExchange("127.0.0.1", store.port, "k", 10.0, publishing=True).publish(43210)
    waiting.join(10)
    assert found == [43210] and store.values == {b"/k": b"43210"}  # torch's key prefix: its client reads it too


def test_a_store_of_another_protocol_is_reached_through_torchs_own_client(fake_torch):
    other = StoreServer(speaks=False)
    try:
        lookup = PortExchange("127.0.0.1", other.port, "k", 10.0, publishing=False)  # waits for the key
        assert lookup.way == "torch's client"
        PortExchange("127.0.0.1", other.port, "k", 10.0, publishing=True).publish(43210)
        assert lookup.lookup() == 43210
        late = PortExchange("127.0.0.1", other.port, "k", 10.0, publishing=False)  # the key there already: its
        assert late.lookup() == 43210  # child says "ready" and the port at once, both lines are read
        with pytest.raises(StoreError, match=rf"^torchrun's store at 127.0.0.1:{other.port}: no rendezvous port from "
                                             r"rank 0 in 0.5 s \(Wait timeout\)$"):
            PortExchange("127.0.0.1", other.port, "never", 0.5, publishing=False).lookup()
    finally:
        other.close()


def test_a_store_that_cannot_be_reached_or_never_gets_the_port_is_one_line(store):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]
    with pytest.raises(StoreError, match=rf"^torchrun's store at 127.0.0.1:{nobody} cannot be reached: Connection "
                                         r"refused$"):
        PortExchange("127.0.0.1", nobody, "k", 5.0, publishing=False).lookup()
    with pytest.raises(StoreError, match=rf"^torchrun's store at 127.0.0.1:{store.port}: no rendezvous port from rank "
                                         r"0 in 0.5 s$"):
        PortExchange("127.0.0.1", store.port, "never", 0.5, publishing=False).lookup()


def test_torchs_client_without_torch_says_so(tmp_path, monkeypatch):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('No module named torch')")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    other = StoreServer(speaks=False)
    try:
        with pytest.raises(StoreError, match=rf"^torchrun's store at 127.0.0.1:{other.port} needs torch, which this "
                                             "Python lacks"):
            PortExchange("127.0.0.1", other.port, "k", 5.0, publishing=False).lookup()
    finally:
        other.close()


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_meet_through_torchruns_store_without_binding_its_port(store, size):
    """MASTER_PORT is the store's: rank 0 listens elsewhere and the job meets."""
    worlds = [World(r, size, r, "127.0.0.1", store.port, "torchrun", "rawgpu/run/attempt_0/rendezvous_port")
              for r in range(size)]
    meetings = [job_module.start_meeting(w, 10.0) for w in reversed(worlds)][::-1]  # rank 0 last
    jobs: dict[int, object] = {}

    def meet(r: int) -> None:
        jobs[r] = job_module.meet(worlds[r], SAME, 10.0, lambda line: None, meetings[r], nccl=False)

    errors = run_ranks(meet, size)
    assert not errors and sorted(jobs) == list(range(size))
    assert sorted(jobs[0].links) == list(range(1, size)) and all(list(jobs[r].links) == [0] for r in range(1, size))
    assert len({jobs[r].unique_id for r in range(size)}) == 1
    for j in jobs.values():
        j.finish()
        j.close()


def test_a_rank_whose_store_fails_ends_with_one_line_naming_it():
    world = World(1, 2, 1, "127.0.0.1", 1, "torchrun", "key")
    with pytest.raises(rv.RendezvousError, match=r"^rank 1 of 2: torchrun's store at 127.0.0.1:1 cannot be reached"):
        job_module.meet(world, SAME, 5.0, print, job_module.start_meeting(world, 5.0), nccl=False)


def test_a_failed_ranks_line_goes_into_torchruns_error_file(tmp_path, capsys):
    path = tmp_path / "error.json"
    tell_launcher("rank 1 of 2: error: boom", {"TORCHELASTIC_ERROR_FILE": str(path)})
    doc = json.loads(path.read_text())
    assert doc["message"] == "rank 1 of 2: error: boom" and isinstance(doc["timestamp"], int)
    tell_launcher("nothing asked for it", {})  # no launcher's file: nothing written, nothing raised
    with pytest.raises(SystemExit) as stop:
        job_module.fail(World(1, 2, 1, "h", 1, "torchrun"), "its local rank names no GPU")
    assert stop.value.code == 1
    assert capsys.readouterr().err == "rawgpu: error: rank 1 of 2: its local rank names no GPU\n"


def test_the_package_imports_neither_torch_nor_jax_but_the_stores_child_torch():
    """rawgpu never needs torch or jax; where torchrun started the process, only the store's fallback child imports
    torch (jobs/torchrun_store.py run as a module)."""
    import re

    root = Path(__file__).resolve().parents[1] / "rawgpu"
    imports = re.compile(r"^\s*(import (?:torch|jax)\b|from (?:torch|jax)[\s.])", re.M)
    for path in root.rglob("*.py"):
        found = imports.findall(path.read_text())
        assert found == (["from torch."] if path.name == "torchrun_store.py" else []), path


def test_the_wire_client_speaks_torchs_own_store_both_ways():
    """Against torch's TCPStore itself (the device machine has torch; here it skips): what WireStore writes, torch's
    client reads, and the other way round."""
    torch_distributed = pytest.importorskip("torch.distributed", reason="torch is not installed here")
    from datetime import timedelta

    from rawgpu.jobs.torchrun_store import WireStore

    server = torch_distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=10))
    wire = WireStore("127.0.0.1", server.port)
    wire.set("rawgpu/x/rendezvous_port", b"12345")
    client = torch_distributed.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("rawgpu/x/rendezvous_port") == b"12345"
    client.set("from torch", b"\x00\xff bytes")
    assert wire.get("from torch", 5.0) == b"\x00\xff bytes"
    with pytest.raises(Exception, match="no rendezvous port from rank 0 in 0.5 s"):
        wire.get("never set", 0.5)
    wire.close()
