"""One run of `python -m rawgpu.train` in this process, on its GPU: build the trainer (fresh, or from the checkpoint to
resume), show its header, fit it with the console, save and plot; the last line's numbers. Rank 0 of a model on
several GPUs runs the same (train_rank.py meets the other ranks first)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from ..model import recipe as rc
from ..runtime.driver import set_watchdog
from ..runtime.errors import interrupt_status
from ..training.trainer import Trainer, TrainingDiverged
from .console import RunInfo, Summary


def _run_info(trainer: Trainer, args, resumed: str) -> RunInfo:
    from ..runtime import compiler, driver

    session, r, plan, data = trainer.session, trainer.recipe, trainer.plan, trainer.data
    dev = session.device
    major, minor = driver.driver_version()
    version = f"CUDA {major}.{minor}"
    try:  # NVML knows the driver's own version number; without it the CUDA version still says enough
        import pynvml

        pynvml.nvmlInit()
        version = f"{pynvml.nvmlSystemGetDriverVersion()} ({version})"
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML is optional here
        pass
    return RunInfo(
        device_name=dev.name, compute_capability=dev.compute_capability, sm_count=dev.sm_count,
        driver_version=version, nvrtc_version="{}.{}".format(*compiler.nvrtc_version()), model=r.name,
        parameters=r.parameters, arena_bytes=session.model.arena.peak_bytes, batch=r.batch, epochs=plan.epochs,
        total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch, lr=r.lr, optimizer=r.optimizer_text,
        schedule=r.schedule, accum=r.accum, graph=not args.no_graph, steps_per_graph=trainer.steps_per_graph,
        pci_bus_id=dev.pci_bus_id, compile_note=session.compile_note, step=session.step_description,
        data=(data.describe() + (f", {r.loss} loss" if r.regression else "")
              + (", standardized" if r.standardize else "")
              + ("" if data.verified else ", structural checks only")), resumed=resumed,
        ranks="" if trainer.rank is None else describe(trainer.rank, session.nccl_seconds))


def summarize(trainer: Trainer, wall_seconds: float, interrupted: bool) -> Summary:
    """The last line's numbers, over every epoch of the run (a resumed run's earlier epochs included)."""
    history = trainer.history
    if trainer.recipe.regression:
        best = min(history, key=lambda h: h.test_rmse if math.isfinite(h.test_rmse) else math.inf, default=None)
        return Summary(train_seconds=trainer.train_seconds, wall_seconds=wall_seconds, steps=trainer.steps_done,
                       best_accuracy=math.nan, best_epoch=best.epoch if best else 0, time_to_98=None,
                       interrupted=interrupted, compile_seconds=trainer.session.compile_seconds,
                       best_rmse=best.test_rmse if best else None)
    best = max(history, key=lambda h: h.test_accuracy if math.isfinite(h.test_accuracy) else -1.0, default=None)
    reached = next((h.total_seconds for h in history if h.test_accuracy >= 0.98), None)
    return Summary(train_seconds=trainer.train_seconds, wall_seconds=wall_seconds, steps=trainer.steps_done,
                   best_accuracy=best.test_accuracy if best else 0.0, best_epoch=best.epoch if best else 0,
                   time_to_98=reached, interrupted=interrupted, compile_seconds=trainer.session.compile_seconds)


def train(args: argparse.Namespace, data, recipe: rc.Recipe, console, t_start: float, ckpt=None,
          rank=None, final=None) -> int:
    """Open the GPU, build the trainer (fresh, or from the checkpoint to resume), run it, report, save, plot.
    rank: this process's ranks.Rank when the model is split over several GPUs (rank 0 reports, saves and plots).
    final: with --val-fraction, the data whose test set the finished model is scored on once (data's test set is
    then the validation rows)."""
    from ..steps import StepOptions

    options = StepOptions(overlap=not args.no_overlap)
    set_watchdog(args.watchdog)
    common = dict(device=args.device, options=options, steps_per_graph=args.steps_per_graph,
                  graphs=not args.no_graph, on_compile=console.compiling, rank=rank)
    root = rank is None or rank.rank == 0
    if ckpt is not None:
        trainer = Trainer._load(ckpt, data=data, **common)
        resumed = f"from {args.resume} at step {trainer.steps_done} of {trainer.plan.total_steps}"
    else:
        trainer = Trainer._make(recipe, data=data, step=args.step, **common)
        resumed = ""
    with trainer:
        console.start(_run_info(trainer, args, resumed))
        interrupted, error = None, None
        try:
            trainer.fit(console.epoch_end, progress=console, save_to=args.save, save_every=args.save_every)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (errors.Terminated)
            interrupted = exc
        except TrainingDiverged as exc:
            error = str(exc)
        console.finish(summarize(trainer, time.perf_counter() - t_start, interrupted is not None))
        scored = trainer.checkpoint() if final is not None and not error and not interrupted and trainer.history \
            else None
        if args.save and not error:
            console.message(save_note(trainer, args.save))
        if args.plot and trainer.history and root:
            from ..training.plot import write_plot

            h = trainer.history
            write_plot(args.plot, [s.epoch for s in h], [s.train_loss for s in h], [s.test_accuracy for s in h],
                       title=f"{data.name} {trainer.recipe.name}",
                       test_rmse=[s.test_rmse for s in h] if trainer.recipe.regression else None)
            console.message(f"plot: {args.plot}")
    if error:
        if root:
            print(f"rawgpu: error: {error}", file=sys.stderr)
        return 1
    if scored is not None and root:
        with Trainer._load(scored, data=final, device=args.device, options=options) as tested:
            console.result(test_record(tested.evaluate(), tested.recipe, len(final.test_labels)))
    return interrupt_status(interrupted) if interrupted else 0


def test_record(result, recipe: rc.Recipe, rows: int) -> dict:
    """The finished model's score on the test set (--val-fraction): what the console prints and --json writes."""
    if recipe.regression:
        return {"test_rows": rows, "test_loss": result.loss, "test_rmse": result.rmse, "test_mae": result.mae,
                "test_r2": result.r2}
    return {"test_rows": rows, "test_loss": result.loss, "test_accuracy": result.accuracy}


def save_note(trainer: Trainer, path: str) -> str:
    """What the run's checkpoint file holds once the run has ended or stopped."""
    if trainer.saved is not None and trainer.saved[1] == trainer.steps_done:
        return f"checkpoint: {path} (step {trainer.steps_done})"
    why = ("interrupted on several GPUs" if trainer.rank is not None and trainer.rank.ranks > 1 else
           "the GPU had not reached a step boundary after the interrupt" if trainer.session.gpu_given_up() else
           "a weight was not finite")
    kept = (f"{path} keeps step {trainer.saved[1]}" if trainer.saved is not None else
            f"{path} keeps the checkpoint it had" if Path(path).exists() else "no checkpoint was written")
    return f"{why}: nothing saved when it stopped; {kept}"


def describe(rank, nccl_seconds: float) -> str:
    """The header's line on the ranks: where they met, and how long the rendezvous and NCCL's start took."""
    from ..runtime import nccl

    init = f"NCCL {nccl.version()} started in {nccl_seconds:.2f} s"
    job = rank.job
    if job is None:
        return f"{rank.ranks} processes on this host, one per GPU; {init}"
    w = job.world
    return (f"{w.size} processes started by {w.launcher}; this is rank 0 on GPU {w.local_rank}; rendezvous at "
            f"{w.master_host}:{w.master_port} in {job.rendezvous_seconds:.2f} s; {init}")
