"""A sweep as a job: `python -m rawgpu.sweep` as one rank of a job that a launcher started on one host or several (torchrun, SLURM,
mpirun, rawgpu.launch --command sweep): each rank trains its share of the grid on its GPU, as `--gpus N` shares it on
one host, and sends each model's history and checkpoint to rank 0 as it finishes; rank 0 writes results.csv/json
and the kept checkpoints. A rank that fails or dies ends the job with a line naming it (job.py); what rank
0 wrote stays, and `--resume DIR` trains the models that were not finished again.

Over the job's links (no NCCL: the ranks never share a tensor): rank 0 sends each rank the indices of its models
(after a resume, only the unfinished ones), each rank sends one message per finished model (a JSON header, then the
checkpoint's safetensors bytes), then one that says it is done.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import struct
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from .launchers import World

_HEADER = struct.Struct("!I")  # the JSON header's length; the checkpoint's bytes follow it


def _message(index: int | None, history: list | None = None, checkpoint: bytes = b"") -> bytes:
    head = json.dumps({"index": index, "history": [dataclasses.asdict(h) for h in history or []],
                       "checkpoint": len(checkpoint)}).encode()
    return _HEADER.pack(len(head)) + head + checkpoint


def _read(blob: bytes) -> tuple[int | None, list, bytes]:
    """(model index or None for 'done', its history, its checkpoint's bytes) of a rank's message."""
    from ..training.stats import EpochStats

    (n,) = _HEADER.unpack_from(blob)
    head = json.loads(blob[_HEADER.size:_HEADER.size + n])
    checkpoint = blob[_HEADER.size + n:]
    if len(checkpoint) != head["checkpoint"]:
        raise ValueError("a sweep message cut short")
    return head["index"], [EpochStats(**h) for h in head["history"]], checkpoint


def run(sweep, world: World, timeout: float, meeting, todo: list[int],
        on_model: Callable[[Any], None]) -> None:
    """Meet the other ranks, train this rank's share of `todo` (rank 0's list of the models left) on GPU
    world.local_rank; rank 0 takes every rank's results as they come (on_model(result) after each is written)."""
    from .. import __version__
    from .job import PART, meet
    from .rendezvous import Identity

    def log(line: str) -> None:
        print(f"rawgpu: rank 0 of {world.size}: {line}", file=sys.stderr, flush=True)

    what = json.dumps(sweep.signature(), sort_keys=True)
    job = meet(world, Identity.of(what, sweep.data.digest(), __version__), timeout, log, meeting, nccl=False)
    try:
        with job.guard():
            if world.rank == 0:
                _run_root(sweep, job, todo, on_model)
            else:
                share = json.loads(job.links[0].parts.get())
                _train(sweep, share["models"], share["keep"], world.local_rank,
                       lambda blob: job.links[0].send(PART, blob))
        job.finish()
    finally:
        job.close()
    if job.end_status is not None:
        raise SystemExit(job.end_status)


def _train(sweep, indices: list[int], keep: bool, device: int, send: Callable[[bytes], None]) -> None:
    """Train these models of the sweep on `device`; send each one's message (with its checkpoint where rank 0 keeps
    checkpoints) as it finishes, then 'done'."""
    from ..training.sweep import train_share

    with tempfile.TemporaryDirectory(prefix="rawgpu-sweep-") as tmp:
        def done(index: int, history: list, path: str | None) -> None:
            checkpoint = Path(path).read_bytes() if path else b""
            if path:
                Path(path).unlink()
            send(_message(index, history, checkpoint))

        together = sweep.together is not False and sweep.together_problem() is None
        train_share([(i, sweep.results[i].recipe) for i in indices], sweep.data, sweep.epochs, sweep.steps,
                    Path(tmp) / "checkpoints" if keep else None, together, device, done)
    send(_message(None))


def _run_root(sweep, job, todo: list[int], on_model: Callable[[Any], None]) -> None:
    """Rank 0: hand out the shares, train its own, and write every model's result as it comes, in one thread that
    alone touches the sweep's results and files."""
    from .job import PART

    size = job.world.size
    keep = sweep.out is not None and bool(sweep.save_all or sweep.save_best)
    for r in range(1, size):
        job.links[r].send(PART, json.dumps({"models": todo[r::size], "keep": keep}).encode())
    inbox: queue.Queue[bytes] = queue.Queue()

    def forward(r: int) -> None:
        while True:
            blob = job.links[r].parts.get()
            inbox.put(blob)
            if _read(blob)[0] is None:
                return

    for r in range(1, size):
        threading.Thread(target=forward, args=(r,), daemon=True, name=f"rawgpu-sweep-{r}").start()
    failed: list[BaseException] = []

    def write_results() -> None:
        running = size
        try:
            while running:
                index, history, checkpoint = _read(inbox.get())
                if index is None:
                    running -= 1
                    continue
                result = sweep.take(index, history, checkpoint)
                on_model(result)
        except BaseException as exc:  # noqa: BLE001 - the main thread raises it, ending the job
            failed.append(exc)

    writer = threading.Thread(target=write_results, daemon=True, name="rawgpu-sweep-results")
    writer.start()
    _train(sweep, todo[0::size], keep, job.world.local_rank, inbox.put)
    while writer.is_alive():
        writer.join(0.2)
    if failed:
        raise failed[0]
