"""Which rank of a job on several hosts this process is, from the environment the launchers people use set.

  torchrun and the Kubernetes training operators   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (where
                                                    TORCHELASTIC_USE_AGENT_STORE=True, torchrun's own store holds
                                                    that port: torchrun_store.py)
  SLURM (srun)                                      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the
                                                    first host of SLURM_JOB_NODELIST, its port MASTER_PORT
  Open MPI (mpirun)                                 OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK; MASTER_ADDR, MASTER_PORT
Plain Python: no torch or MPI is imported. `world_from_environment` names the launcher it recognised and refuses a
half-set or inconsistent environment in one line naming the variable; None where no launcher set one.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Mapping

from .torchrun_store import agent_store_key

DEFAULT_PORT = 29500  # torchrun's, where a launcher gives the host but no port


@dataclass(frozen=True)
class World:
    """This process's place in a job: rank `rank` of `size`, on local GPU `local_rank` of its host; rank 0 serves the
    rendezvous at master_host:master_port. launcher: who set the environment (for messages)."""

    rank: int
    size: int
    local_rank: int
    master_host: str
    master_port: int
    launcher: str
    store_key: str | None = None  # torchrun's agent keeps its store on master_port: rank 0's port is under this key


def _integer(env: Mapping[str, str], name: str, low: int = 0) -> int:
    text = env.get(name, "")
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${name}: expected an integer, got {text!r}") from None
    if value < low:
        raise ValueError(f"${name}: must be >= {low}, got {value}")
    return value


def _port(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    if name not in env:
        return DEFAULT_PORT
    port = _integer(env, name, 1)
    if port > 65535:
        raise ValueError(f"${name}: a TCP port is 1..65535, got {port}")
    return port


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,09],cpu1' -> 'gpu03', 'node7' -> 'node7'."""
    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]*)\])?", nodelist)
    if not m or not m.group(1):
        raise ValueError(f"$SLURM_JOB_NODELIST: no host in {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first.isdigit():
        raise ValueError(f"$SLURM_JOB_NODELIST: cannot read the range {ranges!r} in {nodelist!r}")
    return prefix + first  # zero padding kept: the range says how many digits a name has


def world_from_environment(env: Mapping[str, str]) -> World | None:
    """The World the environment describes (torchrun's variables first, then SLURM's, then Open MPI's), or None where
    none of them is set; ValueError naming the variable for one that is missing or wrong."""
    if "RANK" in env or "WORLD_SIZE" in env:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
            if name not in env:
                raise ValueError(f"${name} is not set, but {'RANK' if name != 'RANK' else 'WORLD_SIZE'} is: torchrun "
                                 "sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together")
        rank, size = _integer(env, "RANK"), _integer(env, "WORLD_SIZE", 1)
        local = _integer(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        launcher = env.get("RAWGPU_LAUNCHER", "torchrun")  # rawgpu.launch and --gpus N set torchrun's variables too
        world = _world(rank, size, local, env["MASTER_ADDR"], _port(env), launcher, ("RANK", "WORLD_SIZE"))
        return replace(world, store_key=agent_store_key(env))
    if "SLURM_PROCID" in env:
        for name in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST"):
            if name not in env:
                raise ValueError(f"${name} is not set, but SLURM_PROCID is: run the ranks with srun")
        host = env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"])
        return _world(_integer(env, "SLURM_PROCID"), _integer(env, "SLURM_NTASKS", 1), _integer(env, "SLURM_LOCALID"),
                      host, _port(env), "SLURM", ("SLURM_PROCID", "SLURM_NTASKS"))
    if "OMPI_COMM_WORLD_RANK" in env:
        for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MASTER_ADDR"):
            if name not in env:
                raise ValueError(f"${name} is not set, but OMPI_COMM_WORLD_RANK is" + (
                    ": mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port> names the rendezvous"
                    if name == "MASTER_ADDR" else ""))
        return _world(_integer(env, "OMPI_COMM_WORLD_RANK"), _integer(env, "OMPI_COMM_WORLD_SIZE", 1),
                      _integer(env, "OMPI_COMM_WORLD_LOCAL_RANK"), env["MASTER_ADDR"], _port(env), "Open MPI",
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
    return None


def _world(rank: int, size: int, local: int, host: str, port: int, launcher: str, names: tuple[str, str]) -> World:
    if rank >= size:
        raise ValueError(f"${names[0]}: rank {rank} is not below ${names[1]} = {size}")
    if not host.strip():
        raise ValueError("the master's host is empty ($MASTER_ADDR)")
    return World(rank, size, local, host.strip(), port, launcher)


ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"


def tell_launcher(line: str, env: Mapping[str, str] = os.environ) -> None:
    """Leave this rank's one-line failure where torchrun looks for it (its error file), so that torchrun's summary of
    the failed job shows the line rather than a hint to enable tracebacks. Nothing where no launcher asked for it."""
    if path := env.get(ERROR_FILE_VARIABLE):
        from ..runtime.files import write_atomic

        try:
            write_atomic(path, json.dumps({"message": line, "timestamp": int(time.time())}).encode())
        except OSError:
            pass  # the line is on stderr already; torchrun then says the rank failed without it
