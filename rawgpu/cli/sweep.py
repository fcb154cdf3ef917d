"""Train many models of one architecture at once: a grid over the optimiser's and the schedule's settings, times seeds.

    python -m rawgpu.sweep --hidden 256 --lr 0.01 0.02 0.05 0.1 --seeds 0-7 --out sweep

Each swept option takes a list (--betas as B1,B2 pairs), --seeds a list or ranges (0-7); the architecture, the batch,
the optimiser and the data (a dataset, or your own table with --data) are one per sweep. Every model has its own seed's weights and data order, its own
settings and optimiser state, as `python -m rawgpu.train` gives it; all of them train together, one step for every
model per graph launch (the models step; --chunk K: K at a time). --one-at-a-time trains each alone instead, with
the very bits `rawgpu.train` gives it.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

from ..model import recipe as rc
from .common import (add_device_option, add_version_option, check_data_options, count, launcher_world, program,
                     seconds, usage_error)
from .tables import add_table_options, check_table_flags, read_table
from ..data.datasets import DATASET_NAMES
from ..runtime.errors import RawgpuError, interrupt_status, stop_on_sigterm
from ..training.grid import SWEPT, Grid, describe_point, parse_seeds

SINGLE = ("hidden", "layers", "batch", "dataset")  # one per sweep: a list is refused (--hidden: a width per layer)


def _pair(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        b1, b2 = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B1,B2 (two numbers), got {text!r}") from None
    for name, b in (("beta1", b1), ("beta2", b2)):
        try:
            rc.OPTIONS["betas"].check(name, b, shown=text)
        except rc.SettingError as exc:
            raise argparse.ArgumentTypeError(f"{name} {exc.reason}") from None
    return b1, b2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=program("sweep"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit status: 0 done, 1 runtime error, 2 bad arguments, 130 Ctrl-C, 143 SIGTERM "
                                       "(the finished models' results are kept; --resume DIR continues).")
    m = p.add_argument_group("model, one per sweep")
    for name in SINGLE[:3]:
        option = rc.OPTIONS[name]
        m.add_argument(f"--{name}", type=rc.argument_type(name, option), nargs="+",
                       default=[None if name == "layers" else option.default], metavar=name.upper(),
                       help=f"{option.help} (default {option.default})")
    m.add_argument("--optimizer", choices=rc.OPTIONS["optimizer"].choices, default=rc.DEFAULTS["optimizer"],
                   help=f"{rc.OPTIONS['optimizer'].help} (default {rc.DEFAULTS['optimizer']})")
    rc.add_options(m, ("activation", "nesterov", "accum"))
    m.add_argument("--epochs", type=count(1), default=None, help=f"epochs per model (default {rc.DEFAULTS['epochs']})")
    m.add_argument("--steps", type=count(1), default=None, help="training steps per model; overrides --epochs")
    s = p.add_argument_group("swept: each takes a list, every combination times every seed is one model")
    for name in SWEPT:
        option, flag = rc.OPTIONS[name], f"--{name.replace('_', '-')}"
        if name == "betas":
            s.add_argument(flag, type=_pair, nargs="+", default=None, metavar="B1,B2", help=option.help)
        elif option.choices is not None:
            s.add_argument(flag, choices=option.choices, nargs="+", default=None, help=option.help)
        else:
            s.add_argument(flag, type=rc.argument_type(name, option), nargs="+", default=None,
                           metavar=name.upper(), help=option.help)
    s.add_argument("--seeds", nargs="+", default=["0"], metavar="SEED",
                   help="seeds, or ranges such as 0-7 (default 0): each model's initial weights and data order")
    d = p.add_argument_group("data and results")
    d.add_argument("--dataset", choices=DATASET_NAMES, nargs="+", default=None,
                   help="the data every model trains on (default mnist)")
    add_table_options(d, split_seed="seed 0 (the same rows for every model)")
    d.add_argument("--data-dir", default=None, help="directory with the four IDX files (default: $RAWGPU_DATA for "
                   "mnist, then the cache, then download)")
    d.add_argument("--out", metavar="DIR", default=None,
                   help="write results.csv and results.json here (updated after every model, atomically)")
    d.add_argument("--save-best", metavar="K", type=count(1), default=0,
                   help="keep the checkpoints of the K best models in DIR/checkpoints (rawgpu checkpoints: "
                        "evaluate, predict and train --resume take them)")
    d.add_argument("--save-all", action="store_true", help="keep every model's checkpoint")
    d.add_argument("--plot", metavar="PATH", default=None,
                   help="write a PNG of each model's best test accuracy against every swept setting (needs "
                        "matplotlib: the plot extra)")
    d.add_argument("--resume", metavar="DIR", default=None,
                   help="continue a sweep interrupted in DIR (its results.json): the finished models are kept, the "
                        "others train; it ends as the uninterrupted sweep ends")
    r = p.add_argument_group("run")
    add_device_option(r)
    r.add_argument("--gpus", type=count(1, 64, what="GPUs"), default=1, metavar="N",
                   help="spread the models over GPUs 0..N-1, one process each (every model ends as on one GPU)")
    r.add_argument("--rendezvous-timeout", type=seconds, default=120.0, metavar="S",
                   help="as one rank of a launcher's job (torchrun, SLURM, mpirun, rawgpu.launch --command sweep): "
                        "how long rank 0 waits for every rank to arrive (default 120)")
    r.add_argument("--chunk", type=count(1, what="models"), default=None, metavar="K",
                   help="train at most K models in one step at a time (default: all that fit the GPU's memory)")
    r.add_argument("--one-at-a-time", action="store_true",
                   help="train each model through its own Trainer, one after another: the very bits rawgpu.train "
                        "gives it (default: all in one step where they share an architecture and optimiser family)")
    r.add_argument("--json", action="store_true",
                   help="print one JSON object per epoch with every model trained together (one per model and epoch "
                        "as each finishes when they train one at a time), nothing else")
    add_version_option(p)
    return p


def grid_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Grid, rc.Recipe]:
    """The grid and the recipe every model shares, checked before any GPU work (one line, exit 2)."""
    for name in SINGLE:
        values = getattr(args, name)
        if name == "hidden" or values is None:  # a width per layer: one architecture; no --dataset
            continue
        if len(values) > 1:
            parser.error(f"argument --{name}: one architecture, batch and dataset per sweep, got {len(values)} "
                         "values; run one sweep per value")
        setattr(args, name, values[0])
    axes = tuple((name, tuple(getattr(args, name))) for name in SWEPT if getattr(args, name) is not None)
    try:
        grid = Grid(axes, parse_seeds(args.seeds))
        hidden, layers = rc.hidden_of(args.hidden, args.layers)
        base = rc.Recipe(hidden=hidden, layers=layers, batch=args.batch, optimizer=args.optimizer,
                         nesterov=args.nesterov, accum=args.accum, activation=args.activation, loss=args.loss,
                         input_dtype=args.input_dtype, standardize=args.standardize)
        recipes = grid.recipes(base)
    except ValueError as exc:
        parser.error(str(exc) if str(exc).startswith("argument") else f"the grid: {exc}")
    total = rc.run_total(base, args.epochs, args.steps)
    for point, r in zip(grid.points(), recipes):  # the rules train.check_run applies to one run
        if r.warmup_steps and r.schedule == "constant":
            parser.error(f"the grid: {describe_point(point)}: a warm-up ramps up to a decaying schedule; sweep "
                         "--schedule cosine or linear with it")
        if r.warmup_steps >= total:
            parser.error(f"the grid: {describe_point(point)}: {r.warmup_steps} warm-up steps is not shorter than the "
                         f"run ({total} steps)")
    return grid, base


def check_output(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        parser.error("argument --out: --resume DIR writes to DIR; drop --out or give the same folder")
    if args.resume and not Path(args.resume).is_dir():
        parser.error(f"argument --resume: no sweep folder {args.resume}")
    args.out = args.out or args.resume
    if args.gpus > 1 and args.device:
        parser.error(f"argument --gpus: the sweep takes GPUs 0..{args.gpus - 1}; drop --device")
    if (args.save_best or args.save_all) and not args.out:
        parser.error("argument --save-best/--save-all: the checkpoints go to --out DIR; give one")
    if args.save_best and args.save_all:
        parser.error("argument --save-all: keeps every model; drop --save-best")
    if args.out:
        from ..runtime.files import cannot_create_in

        folder = Path(args.out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"argument --out: cannot create {folder}: {exc.strerror or exc}")
        if problem := cannot_create_in(folder):
            parser.error(f"argument --out: {problem}")
    if args.plot:  # after --out: the plot may go into that folder
        from ..training.plot import check_plot_path, plot_available

        if problem := check_plot_path(args.plot):
            parser.error(f"argument --plot: {problem}")
        if not plot_available():
            from ..runtime.install import hint

            parser.error(f"argument --plot: needs matplotlib: {hint('plot')}")


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM before any model trained (the set-up: data, GPU)
        print("rawgpu: interrupted before the sweep started", file=sys.stderr)
        return interrupt_status(exc)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    grid, base = grid_of(parser, args)
    check_table_flags(parser, args, args.dataset is not None)
    if args.data is None:
        args.dataset = args.dataset or "mnist"
        if base.regression:
            parser.error(f"argument --loss: {base.loss} is a regression's loss; {args.dataset} has class labels "
                         "(a regression's values come with --data)")
        check_data_options(parser, args.dataset, args.data_dir)
    from ..jobs import sweep_ranks

    world = launcher_world(parser, args)  # one rank of a launcher's job, or None
    if world is None or world.rank == 0:
        check_output(parser, args)
    else:  # rank 0 alone writes the results, the checkpoints and the plot, on its host
        args.out = args.resume = args.plot = None
        args.save_best, args.save_all = 0, False
    quiet = args.json or (world is not None and world.rank != 0)
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))  # noqa: E731
    data, shape = args.dataset, base
    if args.data is not None:  # the table first (host work): the size line gives its shape
        from ..training.trainer import fit_to_data

        try:
            data = read_table(args, 0)
        except RawgpuError as exc:
            print(f"rawgpu: error: {exc}", file=sys.stderr)
            return 1
        try:
            shape = fit_to_data(base, data)
        except ValueError as exc:  # the task does not go with the data: a usage error naming the flag
            usage_error(parser, exc)
    say(f"sweep: {grid.size_line(shape)}, {args.steps} steps each" if args.steps else
        f"sweep: {grid.size_line(shape)}, {args.epochs or rc.DEFAULTS['epochs']} epochs each")
    from ..training.sweep import Sweep

    if args.gpus > 1:
        from ..runtime import driver

        try:
            if args.gpus > (gpus_here := driver.device_count()):
                parser.error(f"argument --gpus: {args.gpus} GPUs asked for, this machine has {gpus_here}")
        except RawgpuError as exc:
            print(f"rawgpu: error: {exc}", file=sys.stderr)
            return 1

    from ..jobs.job import meeting_or_fail

    meeting = meeting_or_fail(world, args.rendezvous_timeout)  # a rank's: overlaps the set-up
    t0, done = time.perf_counter(), 0
    try:
        sweep = Sweep(grid, base, data=data, data_dir=args.data_dir, epochs=args.epochs, steps=args.steps,
                      device=args.device, out=args.out, save_best=args.save_best, save_all=args.save_all,
                      together=False if args.one_at_a_time else None, chunk=args.chunk)
        why = "--one-at-a-time" if args.one_at_a_time else sweep.together_problem()
        say("training: every model in one step (the models step)" + (f", {args.chunk} at a time" if args.chunk else "")
            if why is None else f"training: one model after another ({why})")
        if args.resume:
            try:
                kept = sweep.resume_from(args.resume)
            except ValueError as exc:
                parser.error(f"argument --resume: {exc}")
            say(f"resumed: {kept} of {grid.models} models already trained in {args.resume}")

        live = LiveView(sweep) if sys.stdout.isatty() and not args.json and world is None else None

        def on_model(result) -> None:
            nonlocal done
            done += 1
            if live is not None:
                live.model(result)
                return
            if args.json:
                for stats in result.history:
                    print(json.dumps({"model": result.index, "settings": result.describe(), "epoch": stats.epoch,
                                      "epochs": stats.epochs, **epoch_scores(stats, base.regression)}), flush=True)
            best = sweep.best(1)[0]
            last = result.history[-1]
            say(f"model {result.index + 1}/{grid.models} ({result.describe()}): best test "
                f"{result.best_text()} (epoch {result.best_epoch}), {last.steps_per_s / 1e3:.1f}k "
                f"steps/s; leader: model {best.index + 1} ({best.describe()}) {best.best_text()}")

        training, epochs_seen = [], {}
        epochs_together = why is None and args.gpus == 1  # on_epoch comes for every model at each epoch's end

        def on_start(result) -> None:
            training.append(result.index)
            if live is not None:
                live.start(result)

        def on_epoch(result, stats) -> None:
            if live is not None:
                live.epoch(result, stats)
            if not (args.json and epochs_together):
                return
            rows = epochs_seen.setdefault(stats.epoch, [])
            rows.append({"model": result.index, "settings": result.describe(),
                         **epoch_scores(stats, base.regression)})
            if len(rows) == len(training):  # every model trained together has reported this epoch
                print(json.dumps({"epoch": stats.epoch, "epochs": stats.epochs, "model_steps_per_s":
                                  stats.steps_per_s * len(rows), "samples_per_s": stats.samples_per_s,
                                  "models": rows}), flush=True)
                del epochs_seen[stats.epoch]

        def on_model_done(result) -> None:
            if result.index in training:
                training.remove(result.index)
            if not (args.json and epochs_together):  # their epochs were printed as they ended
                on_model(result)

        try:
            if world is not None:
                sweep_ranks.run(sweep, world, args.rendezvous_timeout, meeting,
                              [r.index for r in sweep.results if not r.done], on_model)
                if world.rank != 0:
                    return 0
            else:
                sweep.fit(on_model=on_model_done, gpus=args.gpus, on_start=on_start, on_epoch=on_epoch)
        except ValueError as exc:  # the models do not fit the GPU's memory
            print(f"rawgpu: error: {exc}", file=sys.stderr)
            return 2
        finally:
            if live is not None:
                live.close()
    except KeyboardInterrupt as exc:
        print(f"rawgpu: interrupted after {done} more model(s)"
              + (f"; {args.out}/results.json keeps the finished ones: --resume {args.out}" if args.out else ""),
              file=sys.stderr)
        return interrupt_status(exc)
    except RawgpuError as exc:
        if world is not None:
            from ..jobs.job import fail

            fail(world, str(exc))
        print(f"rawgpu: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if meeting is not None:
            meeting.close()
    if args.plot:
        sweep.plot(args.plot)
        say(f"plot: {args.plot}")
    if not args.json:
        if live is None:
            print(ranking(sweep, 10))
        wall = time.perf_counter() - t0
        steps = sum(h.steps for r in sweep.results for h in r.history)
        print(f"sweep: {grid.models} models in {wall:.1f} s wall, {steps / wall / 1e3:.1f}k model-steps/s and "
              f"{steps * base.batch / wall / 1e6:.2f}M samples/s with set-up and evaluation"
              + (f"; results in {args.out}" if args.out else ""))
    return 0


def epoch_scores(stats, regression: bool) -> dict:
    """An epoch's scores as --json prints them: the losses and the test accuracy, or a regression's errors."""
    scores = {"train_loss": stats.train_loss, "test_loss": stats.test_loss}
    if regression:
        return {**scores, "test_rmse": stats.test_rmse, "test_mae": stats.test_mae, "test_r2": stats.test_r2}
    return {**scores, "test_accuracy": stats.test_accuracy}


def ranking_table(sweep, top: int):
    """The trained models ranked by their best test accuracy (a regression's: the lowest test RMSE): the `top` best
    and the worst (a rich Table)."""
    from rich.table import Table

    ranked = sweep.best(len(sweep.results))
    shown = ranked[:top] + ([ranked[-1]] if len(ranked) > top else [])
    regression = sweep.base.regression
    table = Table(title=f"{len(ranked)} of {len(sweep.results)} models by best test "
                  + ("RMSE" if regression else "accuracy") + (f" (top {top} and the worst)" if len(ranked) > top else ""))
    for col in ("rank", "model", "settings", "best RMSE" if regression else "best acc", "epoch", "final loss"):
        table.add_column(col, justify="left" if col == "settings" else "right")
    for r in shown:
        best = f"{r.best_rmse:.4g}" if regression else f"{100 * r.best_accuracy:.2f}%"
        table.add_row(str(ranked.index(r) + 1), str(r.index + 1), r.describe(), best, str(r.best_epoch),
                      f"{r.history[-1].train_loss:.4f}")
    return table


def ranking(sweep, top: int) -> str:
    """ranking_table as text."""
    from rich.console import Console

    console = Console(width=120, file=io.StringIO())
    console.print(ranking_table(sweep, top))
    return console.file.getvalue().rstrip("\n")


class LiveView:
    """In a terminal: the ranking and the model in training, redrawn as its epochs end (rich Live)."""

    def __init__(self, sweep, top: int = 10):
        from rich.live import Live

        self.sweep, self.top, self.now = sweep, top, ""
        self.live = Live(self._render(), refresh_per_second=4)
        self.live.start()

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        return Group(ranking_table(self.sweep, self.top), Text(self.now))

    def _show(self, now: str) -> None:
        self.now = now
        self.live.update(self._render())

    def start(self, r) -> None:
        self._show(f"model {r.index + 1}/{len(self.sweep.results)} ({r.describe()}): training")

    def epoch(self, r, s) -> None:
        score = f"test RMSE {s.test_rmse:.4g}" if r.regression else f"test acc {100 * s.test_accuracy:.2f}%"
        self._show(f"model {r.index + 1}/{len(self.sweep.results)} ({r.describe()}): epoch {s.epoch}/{s.epochs}, "
                   f"{score}, {s.steps_per_s / 1e3:.1f}k steps/s, {s.samples_per_s / 1e6:.2f}M samples/s")

    def model(self, r) -> None:
        self._show(f"model {r.index + 1}/{len(self.sweep.results)} done: best test {r.best_text()}")

    def close(self) -> None:
        self.live.stop()


if __name__ == "__main__":
    sys.exit(main())
