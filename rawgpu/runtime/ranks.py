"""One process per GPU: start the ranks, hand them one communicator id, collect what each returns.

A rank is a fresh process ('spawn': no CUDA state carried over from the parent) that runs
`work(rank, ranks, unique_id, *args)`, a module-level function, on GPU `rank`, and sends back its picklable result;
`gather_to_root` brings every rank's value to rank 0 on the way (a checkpoint's parts; in the ranks of a launcher's
job, over the job's links: jobs/job.py).
If a rank fails, or dies without a word, the others are stopped and the error names the rank; Ctrl-C stops every
rank. NVLink multicast stays off in every rank's environment (runtime/nccl.py says why).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import RawgpuError

POLL_SECONDS = 0.2  # how often the parent looks for a rank that died without reporting
STOP_SECONDS = 5.0  # how long a stopped rank gets to exit before it is killed


@dataclass(frozen=True)
class Rank:
    """One process's place among the ranks: `rank` of `ranks`, joining the communicator unique_id; mode: how the
    ranks share the model (parallel.MODES: `auto` lets parallel.choose decide). device: its GPU on this host (None:
    GPU `rank`, as run_ranks starts them); job: the jobs.job.Job of a rank a launcher started (None: run_ranks')."""

    ranks: int
    rank: int
    unique_id: bytes
    mode: str = "auto"
    device: int | None = None
    job: Any = field(default=None, compare=False, repr=False)

    @property
    def gpu(self) -> int:
        """The index of this rank's GPU among the host's."""
        return self.rank if self.device is None else self.device


class RankError(RawgpuError):
    """A rank failed; the message names it and says what it raised (its traceback is in .details)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


_to_root: Any = None  # in a rank's process: the queue gather_to_root sends rank 0 the other ranks' values through
_to_parent: Any = None  # in a rank's process: the queue report() sends the launching process values through
_rank = -1  # in a rank's process: its rank
_sent = 0  # gather_to_root calls made by this rank
_early: dict[tuple[int, int], Any] = {}  # rank 0: values of a later gather that came before this one's


def gather_to_root(value: Any, rank: Rank) -> list[Any] | None:
    """Every rank calls this at the same point of its run with a picklable value: rank 0 gets all of them in rank
    order, the others None (they do not wait). One rank alone gets [value]."""
    global _sent
    if rank.ranks == 1:
        return [value]
    if rank.job is not None:
        return rank.job.gather(value)
    if _to_root is None:
        raise RankError("gather_to_root works in the processes run_ranks starts")
    seq, _sent = _sent, _sent + 1
    if rank.rank:
        _to_root.put((seq, rank.rank, value))
        return None
    got = {0: value}
    for r in range(1, rank.ranks):
        if (seq, r) in _early:
            got[r] = _early.pop((seq, r))
    while len(got) < rank.ranks:
        s, r, v = _to_root.get()
        if s == seq:
            got[r] = v
        else:
            _early[(s, r)] = v
    return [got[r] for r in range(rank.ranks)]


def report(value: Any) -> None:
    """From a rank's process: hand a picklable value to run_ranks' on_report in the launching process at once (a
    result per piece of work as it finishes, so an interruption loses only what is under way)."""
    if _to_parent is None:
        raise RankError("report works in the processes run_ranks starts")
    _to_parent.put((_rank, None, value, ""))


def _rank_main(results: Any, to_root: Any, work: Callable[..., Any], rank: int, ranks: int, unique_id: bytes,
               args: tuple) -> None:
    global _to_root, _to_parent, _rank
    # SIGINT is left as the launcher set it ('spawn' carries an ignored SIGINT into the rank; a handler comes back
    # as Python's default): a foreground run's Ctrl-C reaches every rank, and a run started with SIGINT ignored (a
    # background job of a script) ignores it in every process alike, not in the parent alone.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    _to_root, _to_parent, _rank = to_root, results, rank
    try:
        results.put((rank, True, work(rank, ranks, unique_id, *args), ""))
    except KeyboardInterrupt:
        results.put((rank, False, "interrupted", ""))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent, named
        what = str(exc) if isinstance(exc, RawgpuError) else f"{type(exc).__name__}: {exc}"
        results.put((rank, False, what, traceback.format_exc()))


def run_ranks(work: Callable[..., Any], ranks: int, *args: Any, unique_id: bytes | None = None,
              on_report: Callable[[int, Any], Any] | None = None) -> list[Any]:
    """work(rank, ranks, unique_id, *args) in `ranks` processes; their results in rank order. unique_id: the
    communicator's id every rank is given (default: a fresh one from NCCL; b"" for work that needs none).
    on_report(rank, value): each value a rank hands over with report(), as it comes."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if unique_id is None:
        from . import nccl

        unique_id = nccl.new_unique_id()
    ctx = mp.get_context("spawn")
    results, to_root = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(results, to_root, work, r, ranks, unique_id, args), daemon=True,
                         name=f"rawgpu-rank-{r}") for r in range(ranks)]
    done: dict[int, Any] = {}
    finished = False
    try:
        for p in procs:
            p.start()
        while len(done) < ranks:
            try:
                rank, ok, payload, details = results.get(timeout=POLL_SECONDS)
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode is not None and results.empty():
                        raise RankError(f"rank {r} of {ranks} exited with code {p.exitcode} before reporting")
                continue
            if ok is None:
                if on_report is not None:
                    on_report(rank, payload)
                continue
            if not ok:
                raise RankError(f"rank {rank} of {ranks}: {payload}", details)
            done[rank] = payload
        finished = True
    finally:
        _stop(procs, finished)
        results.close()
        to_root.close()
    return [done[r] for r in range(ranks)]


def _stop(procs: list, finished: bool) -> None:
    """Let ranks that have all reported exit on their own (finished); otherwise ask every live rank to stop. Kill
    what is left after STOP_SECONDS."""
    for p in procs:
        if finished and p.pid is not None:
            p.join(STOP_SECONDS)
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(STOP_SECONDS)
            if p.is_alive():
                p.kill()
                p.join()
