"""A job on several hosts (issue 43, first part): the launchers' environments, and the rendezvous with fake ranks as
threads on localhost: every rank gets rank 0's unique id; a rank that differs, one that never comes, a world size
that disagrees end the job with one line naming the rank; strangers, malformed and oversized messages and wrong
tokens are refused with a logged line while the job goes on waiting for its ranks."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from rawgpu.jobs import rendezvous as rv
from rawgpu.jobs.launchers import DEFAULT_PORT, World, first_host, world_from_environment

UID = bytes(range(128))
SAME = rv.Identity.of("recipe", "mnist sha", "0.1")


# --- the launchers' environments ------------------------------------------------------------------------------------


def test_each_launchers_environment_names_the_rank_and_the_master():
    assert world_from_environment({}) is None
    assert world_from_environment(dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="node0",
                                       MASTER_PORT="1234")) == World(3, 8, 1, "node0", 1234, "torchrun")
    assert world_from_environment(dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="h")).master_port == DEFAULT_PORT
    slurm = dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_NODELIST="gpu[03-05,09],cpu1")
    assert world_from_environment(slurm) == World(5, 8, 1, "gpu03", DEFAULT_PORT, "SLURM")
    assert world_from_environment({**slurm, "MASTER_ADDR": "login", "MASTER_PORT": "7"}).master_host == "login"
    mpi = dict(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="0", MASTER_ADDR="a")
    assert world_from_environment(mpi) == World(2, 4, 0, "a", DEFAULT_PORT, "Open MPI")
    assert [first_host(s) for s in ("node7", "n[1-3]", "a[007,9]", " x[10-11],y")] == ["node7", "n1", "a007", "x10"]


@pytest.mark.parametrize("env,message", [
    (dict(RANK="1", MASTER_ADDR="h"), r"^\$WORLD_SIZE is not set, but RANK is"),
    (dict(WORLD_SIZE="2", MASTER_ADDR="h"), r"^\$RANK is not set, but WORLD_SIZE is"),
    (dict(RANK="1", WORLD_SIZE="2"), r"^\$MASTER_ADDR is not set"),
    (dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="h"), r"^\$RANK: rank 2 is not below \$WORLD_SIZE = 2"),
    (dict(RANK="x", WORLD_SIZE="2", MASTER_ADDR="h"), r"^\$RANK: expected an integer, got 'x'"),
    (dict(RANK="0", WORLD_SIZE="0", MASTER_ADDR="h"), r"^\$WORLD_SIZE: must be >= 1, got 0"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="70000"), r"^\$MASTER_PORT: a TCP port is 1..65535"),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0"), r"^\$SLURM_JOB_NODELIST is not set"),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_NODELIST="[1-2]"),
     r"^\$SLURM_JOB_NODELIST: no host"),
    (dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0"),
     r"^\$MASTER_ADDR is not set, but OMPI_COMM_WORLD_RANK is: mpirun -x MASTER_ADDR"),
])
def test_a_half_set_environment_is_one_line_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        world_from_environment(env)


# --- the rendezvous -----------------------------------------------------------------------------------------------


class Job:
    """Rank 0 serving on a localhost port the system picks; ranks join from threads."""

    def __init__(self, size: int, timeout: float = 10.0, token: bytes = b"", identity: rv.Identity = SAME):
        self.size, self.token, self.logged, self.error = size, token, [], None
        started, self.port = threading.Event(), None

        def ready(port):
            self.port = port
            started.set()

        def run():
            try:
                links = rv.serve("127.0.0.1", 0, size, identity, UID, timeout, token, self.logged.append, ready)
                self.linked = sorted(links)
                for link in links.values():
                    link.close()
            except rv.RendezvousError as exc:
                self.error = str(exc)
            started.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.results: dict[int, object] = {}
        self.joiners: list[threading.Thread] = []

    def join_as(self, rank: int, size: int | None = None, identity: rv.Identity = SAME, token: bytes | None = None):
        def run():
            try:
                uid, link = rv.join("127.0.0.1", self.port, rank, size or self.size, identity, 10.0,
                                    self.token if token is None else token)
                link.close()
                self.results[rank] = uid
            except rv.RendezvousError as exc:
                self.results[rank] = str(exc)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.joiners.append(t)
        return t

    def finish(self):
        self.thread.join(15)
        for t in self.joiners:
            t.join(15)
        assert not self.thread.is_alive()

    def send_raw(self, data: bytes) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(data)


@pytest.mark.parametrize("size", [4, 8, 16])  # one host of 4 or 8 GPUs, two hosts of 8
def test_every_rank_gets_rank_0s_unique_id(size):
    job = Job(size)
    for r in reversed(range(1, size)):
        job.join_as(r)
    job.finish()
    ranks = list(range(1, size))
    assert job.error is None and job.results == dict.fromkeys(ranks, UID) and job.logged == [] and job.linked == ranks


def test_strangers_malformed_oversized_and_wrong_tokens_are_refused_while_the_job_waits():
    token = os.urandom(16)
    job = Job(3, token=token)
    job.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 200)  # a stranger
    job.send_raw(rv.hello(1, 3, SAME, token)[:-4])  # cut short
    oversized = struct.pack("!8sHII96sH", rv.MAGIC, rv.VERSION, 1, 3, b"\0" * 96, 60000)
    job.send_raw(oversized + b"t" * 1000)
    job.send_raw(rv.hello(1, 3, SAME, b"wrong token!"))
    job.send_raw(rv.hello(7, 3, SAME, token))  # no such rank
    job.join_as(1)
    time.sleep(0.5)  # rank 1 has arrived (it waits for rank 2)
    job.send_raw(rv.hello(1, 3, SAME, token))  # rank 1 again
    job.join_as(2)
    job.finish()
    assert job.error is None and job.results == {1: UID, 2: UID}
    reasons = [line.split(": ", 2)[2] for line in job.logged]
    assert reasons == ["not a rawgpu rank (wrong magic or version)", "closed early",
                       "a token of 60000 bytes (at most 256)",
                       "a wrong token ($RAWGPU_RENDEZVOUS_TOKEN differs from rank 0's)", "rank 7 is not one of 1..2",
                       "rank 1 came already"], job.logged
    assert all(line.startswith("rendezvous: refused 127.0.0.1:") for line in job.logged)


@pytest.mark.parametrize("other,what", [(rv.Identity.of("other recipe", "mnist sha", "0.1"), "recipe"),
                                        (rv.Identity.of("recipe", "fashion sha", "0.1"), "dataset"),
                                        (rv.Identity.of("recipe", "mnist sha", "0.2"), "rawgpu version")])
def test_a_rank_that_differs_ends_the_job_with_a_line_naming_it(other, what):
    job = Job(3)
    job.join_as(1)
    time.sleep(0.5)  # rank 1 has arrived (it waits for rank 2)
    job.join_as(2, identity=other)
    job.finish()
    line = f"rendezvous: rank 2 has another {what} than rank 0"
    assert job.error == line and job.results == {1: line, 2: line}


def test_a_world_size_that_disagrees_ends_the_job():
    job = Job(3)
    job.join_as(1, size=4)
    job.finish()
    assert job.error == "rendezvous: rank 1 says the job has 4 ranks, rank 0 says 3" == job.results[1]


def test_ranks_that_never_come_are_named_after_the_timeout():
    job = Job(4, timeout=1.0)
    job.join_as(2)
    job.finish()
    line = f"rendezvous: ranks 1, 3 of 4 did not arrive at 127.0.0.1:{job.port} in 1 s"  # the port it listened on
    assert job.error == line == job.results[2]


def test_a_rank_with_no_rank_0_says_so_after_its_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nobody listens there
    with pytest.raises(rv.RendezvousError, match=f"^rendezvous: could not reach rank 0 at 127.0.0.1:{port} in 0.5 s "
                                                 r"\(Connection refused\)$"):
        rv.join("127.0.0.1", port, 1, 2, SAME, 0.5)
    with pytest.raises(ValueError, match="RAWGPU_RENDEZVOUS_TOKEN: at most 256 bytes"):
        rv.hello(1, 2, SAME, b"x" * 300)


def test_a_rank_with_a_wrong_token_is_told_why_while_rank_0_goes_on_waiting():
    job = Job(2, token=b"right", timeout=3.0)
    with pytest.raises(rv.RendezvousError, match=r"^rendezvous: rank 0 refused this rank: a wrong token "
                                                 r"\(\$RAWGPU_RENDEZVOUS_TOKEN differs from rank 0's\)$"):
        rv.join("127.0.0.1", job.port, 1, 2, SAME, 3.0, b"wrong")
    job.join_as(1)
    job.finish()
    assert job.error is None and job.results == {1: UID} and len(job.logged) == 1


def test_a_port_in_use_is_one_line_naming_the_address():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(rv.RendezvousError, match=rf"^rendezvous: rank 0 cannot listen at 127.0.0.1:{port}: "
                                                     r"Address already in use \(another program holds it"):
            rv.serve("127.0.0.1", port, 2, SAME, UID, 1.0)


def test_a_master_host_that_does_not_resolve_fails_at_once_not_after_the_timeout():
    t = time.monotonic()
    with pytest.raises(rv.RendezvousError, match=r"^rendezvous: rank 0's host 'no-such-host.invalid' is not known"):
        rv.join("no-such-host.invalid", 29500, 1, 2, SAME, 60.0)
    assert time.monotonic() - t < 30  # not the 60 s timeout: a name that does not resolve is final


def _meet_ranks_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_that_real_mpirun_starts_meet_and_gather_to_rank_0():
    """Open MPI's variables as mpirun sets them (the rendezvous part: no GPU, no NCCL). Needs Debian's openmpi-bin."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed here (Debian: apt-get install openmpi-bin)")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", "MASTER_ADDR=127.0.0.1",
                        "-x", f"MASTER_PORT={_meet_ranks_port()}", "-x", f"PYTHONPATH={root}", sys.executable,
                        str(root / "tests" / "meet_ranks.py")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"rank {r} of 4 (Open MPI): part of rank {r}" for r in range(4)]


def test_ranks_with_slurms_variables_meet_at_the_node_lists_first_host():
    """srun's variables, set by hand as srun sets them on one node (SLURM itself is not here)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "localhost",
           "MASTER_PORT": str(_meet_ranks_port())}
    procs = [subprocess.Popen([sys.executable, str(root / "tests" / "meet_ranks.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in range(3)]
    out = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], out
    assert out[0][0].splitlines() == [f"rank {r} of 3 (SLURM): part of rank {r}" for r in range(3)]
