"""`python -m rawgpu.train`: train an MLP on MNIST, one CUDA graph launch per training step."""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import recipe as rc
from . import steps
from .errors import RawgpuError, StepUnsupported

PROGRESS_TICKS = 50  # progress events per epoch
MAX_AHEAD = 8  # progress ticks the host may queue ahead of the GPU: bounds Ctrl-C latency, never starves it
RECIPE_OPTIONS = ("hidden", "layers", "batch", "epochs", "lr", "momentum", "schedule", "warmup", "accum", "seed")


def _count(low: int, high: int | None = None, what: str = "count"):
    """An argparse type for the run options that are not part of the recipe."""
    return rc.argument_type(what, rc.Option(None, int, low, high))


def build_parser() -> argparse.ArgumentParser:
    d = rc.DEFAULTS
    description = (f"{__doc__}\n\nDefault recipe (reaches >= 98% test accuracy at --hidden {d['hidden']}): batch "
                   f"{d['batch']}, SGD with momentum {d['momentum']},\nlr {d['lr']} with a {d['schedule']} decay to 0 "
                   f"over the run, {d['epochs']} epochs, {d['accum']} accumulation, seed {d['seed']}.")
    p = argparse.ArgumentParser(
        prog="python -m rawgpu.train", description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 done, 1 runtime error (no GPU, out of memory, data), 2 bad arguments, 130 Ctrl-C.")
    rc.add_options(p.add_argument_group("model"), RECIPE_OPTIONS[:2])
    o = p.add_argument_group("optimisation")
    rc.add_options(o, RECIPE_OPTIONS[2:4])
    o.add_argument("--steps", type=_count(1), default=None,
                   help="total training steps; overrides --epochs (the benchmark workload uses 5000)")
    rc.add_options(o, RECIPE_OPTIONS[4:])
    r = p.add_argument_group("run")
    r.add_argument("--data-dir", default=None, help="directory with the four MNIST IDX files (raw or .gz); "
                   "default: $RAWGPU_DATA, then the cache, then download")
    r.add_argument("--device", type=_count(0, what="index"), default=0, help="GPU index (default 0)")
    r.add_argument("--no-graph", action="store_true",
                   help="launch the same kernels one by one instead of one CUDA graph per step (for comparison)")
    r.add_argument("--steps-per-graph", type=_count(1, 1000), default=1,
                   help="training steps captured into one graph (default 1)")
    add_step_option(r)
    r.add_argument("--no-overlap", action="store_true",
                   help="layered step on sm_90+: start each kernel only when the one before has finished, instead of "
                        "overlapping its start with that kernel's end (programmatic dependent launch; for comparison)")
    r.add_argument("--json", action="store_true", help="print one JSON object per epoch on stdout and nothing else")
    return p


def add_step_option(parser) -> None:
    """`--step` (alias `--kernels`): the step kind, with the chooser's own rule as help (every CLI shares it)."""
    parser.add_argument("--step", "--kernels", dest="step", choices=steps.CHOICES, default="auto",
                        help=steps.help_text())


def check_step_option(parser: argparse.ArgumentParser, recipe: rc.Recipe, kind: str) -> None:
    """A named step kind that cannot run the recipe is a usage error before any GPU work. The recipe's limits are
    checked against the most capable GPU here; the GPU's own arch is checked once it is open."""
    try:
        steps.choose(recipe, "sm_90", kind)
    except StepUnsupported as exc:
        parser.error(f"argument --step: {exc}")


@dataclass
class Plan:
    """How many steps run in each epoch."""

    epochs: int
    total_steps: int
    steps_per_epoch: int

    def steps_in(self, epoch: int) -> int:
        return min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)


def make_plan(args: argparse.Namespace) -> Plan:
    total, epochs = rc.run_length(args.batch, args.epochs, args.steps)
    return Plan(epochs, total, rc.TRAIN_ROWS // args.batch)


def make_recipe(args: argparse.Namespace, plan: Plan) -> rc.Recipe:
    return rc.from_args(args, plan.total_steps)


def _run_info(session, args, plan: Plan):
    from . import compiler, driver
    from .console import RunInfo

    dev, r = session.device, session.model.recipe
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
        total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch, lr=r.lr, momentum=r.momentum,
        schedule=r.schedule, accum=r.accum, graph=not args.no_graph, steps_per_graph=args.steps_per_graph,
        pci_bus_id=dev.pci_bus_id, compile_note=session.compile_note, step=session.step_description)


def train(args: argparse.Namespace, plan: Plan, recipe: rc.Recipe, console, t_start: float) -> int:
    """Set up, then the host loop: per epoch upload a shuffle, launch graphs, evaluate, read metrics once."""
    from .console import EpochStats, Summary
    from .data import load_mnist
    from .driver import Event
    from .kernels.data import lr_at
    from .session import Session
    from .steps import StepOptions

    data = load_mnist(args.data_dir)  # before the GPU and the compile: a data problem costs nothing else
    session = Session(recipe, args.device, on_compile=console.message, step_kind=args.step,
                      options=StepOptions(overlap=not args.no_overlap))
    model, stream = session.model, session.stream
    model.upload_data(data)
    model.init_parameters(stream)
    console.start(_run_info(session, args, plan))

    k = min(args.steps_per_graph, plan.total_steps)
    step_graph = None if args.no_graph else session.capture_step(1)
    multi_graph = None if args.no_graph or k == 1 else session.capture_step(k)
    eval_graph = session.capture_eval()
    events = [Event() for _ in range(MAX_AHEAD + 3)]
    rng = np.random.default_rng(args.seed)
    flops, traffic = recipe.step_flops(), recipe.step_bytes()

    def run_steps(n: int) -> None:
        """Enqueue n steps: whole multi-step graphs, then single steps."""
        done = 0
        while done < n:
            if multi_graph is not None and n - done >= k:
                multi_graph.launch(stream)
                done += k
            elif step_graph is not None:
                step_graph.launch(stream)
                done += 1
            else:
                for launch in session.step:
                    launch.run(stream)
                done += 1

    best, best_epoch, time_to_98, train_s, steps_done, interrupted = -1.0, 0, None, 0.0, 0, False
    diverged = None
    try:
        for epoch in range(plan.epochs):
            n = plan.steps_in(epoch)
            model.set_permutation(rng.permutation(rc.TRAIN_ROWS))
            model.zero_metrics().run(stream)
            console.epoch_begin(epoch + 1, plan.epochs, n)
            start, end, eval_end = events[0], events[1], events[2]
            ticks = events[3:]
            start.record(stream)
            # Progress: an event every n/PROGRESS_TICKS steps; the host waits for the oldest when it is MAX_AHEAD
            # ticks in front, so the GPU always has queued work and Ctrl-C takes effect within a few ticks.
            chunk, free, pending, launched = max(k, -(-n // PROGRESS_TICKS) // k * k), list(ticks), [], 0
            while launched < n:
                m = min(chunk, n - launched)
                run_steps(m)
                launched += m
                if not free:
                    ev, at = pending.pop(0)
                    ev.synchronize()
                    console.epoch_progress(at)
                    free.append(ev)
                pending.append((free.pop().record(stream), launched))
            end.record(stream)
            eval_graph.launch(stream)
            eval_end.record(stream)
            for ev, at in pending:
                ev.synchronize()
                console.epoch_progress(at)
            seconds, eval_seconds = start.elapsed_ms(end) / 1e3, end.elapsed_ms(eval_end) / 1e3
            loss_sum, correct = model.train_metrics()
            test_loss, test_acc = model.eval_metrics()
            train_s += seconds
            steps_done += n
            if test_acc > best:
                best, best_epoch = test_acc, epoch + 1
            if time_to_98 is None and test_acc >= 0.98:
                time_to_98 = train_s
            train_loss = loss_sum / (n * recipe.batch)
            console.epoch_end(EpochStats(
                epoch=epoch + 1, epochs=plan.epochs, steps=n, train_loss=train_loss,
                train_accuracy=correct / (n * recipe.batch), test_loss=test_loss, test_accuracy=test_acc,
                seconds=seconds, eval_seconds=eval_seconds, steps_per_s=n / seconds,
                samples_per_s=n * recipe.batch / seconds, tflops=flops * n / seconds / 1e12,
                gbps=traffic * n / seconds / 1e9,
                lr=lr_at(steps_done - 1, recipe.lr, recipe.lr_min, recipe.total_steps, recipe.warmup_steps,
                         recipe.schedule), total_seconds=train_s))
            if not math.isfinite(train_loss):  # every later step would train on NaN: stop at this epoch's end
                diverged = (f"training diverged in epoch {epoch + 1}: the train loss is {train_loss}; the learning "
                            f"rate (--lr {recipe.lr:g}) is the likely cause, try a smaller one")
                break
    except KeyboardInterrupt:
        interrupted = True
        stream.synchronize()  # the queued steps finish: parameters stop at a step boundary
        steps_done = model.step_count()
    console.finish(Summary(train_seconds=train_s, wall_seconds=time.perf_counter() - t_start, steps=steps_done,
                           best_accuracy=max(best, 0.0), best_epoch=best_epoch, time_to_98=time_to_98,
                           interrupted=interrupted))
    if diverged:
        print(f"rawgpu: error: {diverged}", file=sys.stderr)
        return 1
    return 130 if interrupted else 0


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_graph and args.steps_per_graph != 1:
        parser.error("--steps-per-graph needs graphs; drop it or --no-graph")
    plan = make_plan(args)
    if args.warmup and args.schedule == "constant":
        parser.error("argument --warmup: a warm-up ramps up to a decaying schedule: use --schedule cosine or linear")
    if args.warmup >= plan.total_steps:
        parser.error(f"argument --warmup: {args.warmup} steps is not shorter than the run ({plan.total_steps} steps)")
    if args.data_dir is not None:
        from .data import missing_files

        if missing := missing_files(args.data_dir):
            parser.error(f"argument --data-dir: {args.data_dir} lacks " + ", ".join(missing) + " (raw or .gz)"
                         if Path(args.data_dir).expanduser().is_dir() else
                         f"argument --data-dir: no directory {args.data_dir}")
    recipe = make_recipe(args, plan)
    check_step_option(parser, recipe, args.step)
    from .console import make_console

    console = make_console("json" if args.json else "auto")
    try:
        from . import driver

        driver.init()
        count = driver.device_count()
        if args.device >= count:
            parser.error(f"argument --device: no GPU with index {args.device}; this machine has {count} "
                         f"(0..{count - 1})" if count else "argument --device: this machine has no CUDA GPU")
        return train(args, plan, recipe, console, t_start)
    except StepUnsupported as exc:  # the step kind asked for, on this GPU's arch: a usage error too
        console.close()
        print(f"rawgpu: error: argument --step: {exc}", file=sys.stderr)
        return 2
    except RawgpuError as exc:
        console.close()
        print(f"rawgpu: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        console.close()
        print("rawgpu: interrupted before training started", file=sys.stderr)
        return 130
    finally:
        console.close()


if __name__ == "__main__":
    sys.exit(main())
