"""`python -m rawgpu.train`: train an MLP on MNIST, one CUDA graph launch per training step.

Default recipe (reaches >= 98% test accuracy at --hidden 256): batch 128, SGD with momentum 0.9,
lr 0.05 with a cosine decay to 0 over the run, 8 epochs, fp32 accumulation, seed 0.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from .errors import NoDeviceError, RawgpuError

DEFAULTS = dict(hidden=256, layers=3, batch=128, epochs=8, lr=0.05, momentum=0.9, schedule="cosine", warmup=0,
                accum="fp32", seed=0, steps_per_graph=1, kernels="auto")
PROGRESS_TICKS = 50  # progress events per epoch
MAX_AHEAD = 8  # progress ticks the host may queue ahead of the GPU: bounds Ctrl-C latency, never starves it


def _number(kind, low=None, high=None, low_open=False, what="value"):
    """An argparse type: parse `kind`, then check the range, so errors read 'must be ...' with the bad value."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value
    parse.__name__ = what  # argparse names the type in some messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m rawgpu.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 done, 1 runtime error (no GPU, out of memory, data), 2 bad arguments, 130 Ctrl-C.")
    m = p.add_argument_group("model")
    m.add_argument("--hidden", type=_number(int, 1, what="width"), default=d["hidden"],
                   help=f"hidden layer width (default {d['hidden']}; multiples of 64 are the fast path)")
    m.add_argument("--layers", type=_number(int, 1, 64, what="count"), default=d["layers"],
                   help=f"number of hidden layers (default {d['layers']})")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch", type=_number(int, 1, 60000, what="size"), default=d["batch"],
                   help=f"batch size, 1..60000 (default {d['batch']})")
    o.add_argument("--epochs", type=_number(int, 1, what="count"), default=d["epochs"],
                   help=f"passes over the 60k training images (default {d['epochs']})")
    o.add_argument("--steps", type=_number(int, 1, what="count"), default=None,
                   help="total training steps; overrides --epochs (the benchmark workload uses 5000)")
    o.add_argument("--lr", type=_number(float, 0.0, low_open=True, what="rate"), default=d["lr"],
                   help=f"peak learning rate (default {d['lr']})")
    o.add_argument("--momentum", type=_number(float, 0.0, 0.999, what="momentum"), default=d["momentum"],
                   help=f"SGD momentum, 0 for plain SGD (default {d['momentum']})")
    o.add_argument("--schedule", choices=("constant", "cosine", "linear"), default=d["schedule"],
                   help=f"learning-rate schedule over the run (default {d['schedule']}: decays to 0)")
    o.add_argument("--warmup", type=_number(int, 0, what="steps"), default=d["warmup"],
                   help="linear warm-up steps for cosine/linear (default 0)")
    o.add_argument("--accum", choices=("fp32", "fp16"), default=d["accum"],
                   help="GEMM accumulator precision (default fp32)")
    o.add_argument("--seed", type=_number(int, 0, 2**63 - 1, what="seed"), default=d["seed"],
                   help="seed for the initial weights and the shuffles (default 0)")
    r = p.add_argument_group("run")
    r.add_argument("--data-dir", default=None, help="directory with the four MNIST IDX files (raw or .gz); "
                   "default: $RAWGPU_DATA, then the cache, then download")
    r.add_argument("--device", type=_number(int, 0, what="index"), default=0, help="GPU index (default 0)")
    r.add_argument("--no-graph", action="store_true",
                   help="launch the same kernels one by one instead of one CUDA graph per step (for comparison)")
    r.add_argument("--steps-per-graph", type=_number(int, 1, 1000, what="count"), default=d["steps_per_graph"],
                   help=f"training steps captured into one graph (default {d['steps_per_graph']})")
    r.add_argument("--kernels", choices=("auto", "cluster", "fused", "layered"), default=d["kernels"],
                   help="cluster: one thread-block cluster keeps the model in shared memory (sm_90, batch <= 32, "
                        "momentum 0, hidden <= 128 at 3 layers); fused: the whole step in one persistent kernel; "
                        "layered: one kernel per layer and role (8-19 at 3 hidden layers); auto (default): cluster, "
                        "else layered where it is 8 kernels (sm_90, batch <= 32, momentum 0, fp32 accumulation), else "
                        "fused (fp32 accumulation, hidden <= 512), else layered, whichever applies first")
    r.add_argument("--no-overlap", action="store_true",
                   help="layered step on sm_90+: start each kernel only when the one before has finished, instead of "
                        "overlapping its start with that kernel's end (programmatic dependent launch; for comparison)")
    r.add_argument("--json", action="store_true", help="print one JSON object per epoch on stdout and nothing else")
    return p


@dataclass
class Plan:
    """How many steps run in each epoch."""

    epochs: int
    total_steps: int
    steps_per_epoch: int

    def steps_in(self, epoch: int) -> int:
        return min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)


def make_plan(args: argparse.Namespace) -> Plan:
    spe = 60000 // args.batch
    total = args.steps if args.steps is not None else args.epochs * spe
    return Plan(-(-total // spe), total, spe)


def make_recipe(args: argparse.Namespace, plan: Plan):
    from .mlp import Recipe

    return Recipe(hidden=args.hidden, layers=args.layers, batch=args.batch, lr=args.lr, momentum=args.momentum,
                  schedule=args.schedule, warmup_steps=args.warmup, lr_min=0.0, total_steps=plan.total_steps,
                  accum=args.accum, seed=args.seed)


class Session:
    """Device, compiled kernels and the planned, allocated model: everything training and inspect_graph share."""

    def __init__(self, recipe, device_index: int = 0, on_compile=None, kernels: str = "auto",
                 fused_grid: int | None = None, overlap: bool = True, l2_budget: float | None = None):
        from . import compiler
        from .driver import Device, Stream
        from .kernels import Kernels
        from .kernels.l2 import DEFAULT_BUDGET
        from .mlp import MLP, STEP_KINDS

        if kernels not in STEP_KINDS:  # a bad value fails before any GPU work
            raise ValueError(f"kernels must be one of {', '.join(STEP_KINDS)}, got {kernels!r}")
        self.device = Device(device_index)
        arch = self.device.arch
        if arch not in compiler.supported_archs():
            raise NoDeviceError(f"{self.device.name} is {arch}; this NVRTC builds for "
                                f"{', '.join(compiler.supported_archs())} (rawgpu needs sm_80 or newer)")
        if self.device.compute_capability < (8, 0):
            raise NoDeviceError(f"{self.device.name} is {arch}: rawgpu needs sm_80 or newer (mma.sync, cp.async)")
        self.kernels = Kernels(arch)
        cold = [s for s in compiler.all_sources() if not compiler.is_cached(s, arch)]
        if cold and on_compile:
            on_compile(f"compiling kernels for {arch} (first run only: the cubins are cached in "
                       f"{compiler.cache_dir()})")
        t = time.perf_counter()
        self.kernels.load_all()
        ms = (time.perf_counter() - t) * 1e3
        self.compile_note = (f"kernels compiled in {ms / 1e3:.1f} s (first run)" if cold
                             else f"kernel cache warm ({ms:.0f} ms)")
        self.stream = Stream()
        try:
            model = MLP(self.kernels, recipe, self.device.sm_count, step=kernels, fused_grid=fused_grid,
                        overlap=overlap, l2_bytes=self.device.l2_bytes,
                        l2_budget=DEFAULT_BUDGET if l2_budget is None else l2_budget)
        except ValueError as exc:
            raise RawgpuError(f"--kernels {kernels}: {exc}") from None
        self.model = model.allocate()
        self.step = self.model.step_launches()

    @property
    def step_kernels(self) -> str:
        """How a step runs, for headers: the cluster or fused kernel's grid, or the layered kernel count."""
        if self.model.cluster:
            p = self.model.cluster_plan
            return (f"cluster: 1 kernel, {p.ctas} CTAs sharing the model in shared memory "
                    f"({p.smem_bytes // 1024} KB each)")
        if self.model.fused:
            launch = self.step[0]
            return f"fused: 1 persistent kernel, {launch.grid[0]} blocks x {launch.block[0]} threads"
        how = ", each overlapping the one before (programmatic dependent launch)" if self.model.overlap else ""
        return f"layered: {len(self.step)} kernels{how}"

    def capture_step(self, steps: int = 1):
        """The training step, `steps` times over, as one instantiated graph (uploaded, ready to launch)."""
        from .graph import capture
        from .mlp import run_launches

        graph = capture(self.stream, run_launches(self.model.step_launches(steps), self.stream))
        graph.upload(self.stream)
        return graph

    def capture_eval(self):
        from .graph import capture
        from .mlp import run_launches

        graph = capture(self.stream, run_launches(self.model.eval_launches(), self.stream))
        graph.upload(self.stream)
        return graph


def _run_info(session: Session, args, plan: Plan):
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
        pci_bus_id=dev.pci_bus_id, compile_note=session.compile_note, step_kernels=session.step_kernels)


def train(args: argparse.Namespace, console, t_start: float) -> int:
    """Set up, then the host loop: per epoch upload a shuffle, launch graphs, evaluate, read metrics once."""
    from .console import EpochStats, Summary
    from .data import load_mnist
    from .driver import Event
    from .kernels.data import lr_at
    from .mlp import TRAIN_ROWS

    plan = make_plan(args)
    recipe = make_recipe(args, plan)
    session = Session(recipe, args.device, on_compile=console.message, kernels=args.kernels,
                      overlap=not args.no_overlap)
    model, stream = session.model, session.stream
    data = load_mnist(args.data_dir)
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

    best, best_epoch, time_to_98, train_s, steps_done, interrupted = 0.0, 0, None, 0.0, 0, False
    try:
        for epoch in range(plan.epochs):
            n = plan.steps_in(epoch)
            model.set_permutation(rng.permutation(TRAIN_ROWS))
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
            console.epoch_end(EpochStats(
                epoch=epoch + 1, epochs=plan.epochs, steps=n, train_loss=loss_sum / (n * recipe.batch),
                train_accuracy=correct / (n * recipe.batch), test_loss=test_loss, test_accuracy=test_acc,
                seconds=seconds, eval_seconds=eval_seconds, steps_per_s=n / seconds,
                samples_per_s=n * recipe.batch / seconds, tflops=flops * n / seconds / 1e12,
                gbps=traffic * n / seconds / 1e9,
                lr=lr_at(steps_done - 1, recipe.lr, recipe.lr_min, recipe.total_steps, recipe.warmup_steps,
                         recipe.schedule), total_seconds=train_s))
    except KeyboardInterrupt:
        interrupted = True
        stream.synchronize()  # the queued steps finish: parameters stop at a step boundary
        steps_done = model.step_count()
    console.finish(Summary(train_seconds=train_s, wall_seconds=time.perf_counter() - t_start, steps=steps_done,
                           best_accuracy=best, best_epoch=best_epoch, time_to_98=time_to_98,
                           interrupted=interrupted))
    return 130 if interrupted else 0


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_graph and args.steps_per_graph != 1:
        parser.error("--steps-per-graph needs graphs; drop it or --no-graph")
    if args.kernels == "fused":
        from .kernels.fused import unsupported_reason

        if why := unsupported_reason(args):  # reads accum and layers, which args carries too
            parser.error(f"argument --kernels: fused cannot run this recipe: {why}")
    if args.kernels == "cluster":
        from .kernels.cluster import unsupported_reason as cluster_reason

        if why := cluster_reason(args, "sm_90"):  # the recipe's limits; the GPU's arch is checked once it is open
            parser.error(f"argument --kernels: cluster cannot run this recipe: {why}")
    from .console import make_console

    console = make_console("json" if args.json else "auto")
    try:
        from . import driver

        driver.init()
        count = driver.call(driver._cu().cuDeviceGetCount)
        if args.device >= count:
            parser.error(f"argument --device: no GPU with index {args.device}; this machine has {count} "
                         f"(0..{count - 1})" if count else "argument --device: this machine has no CUDA GPU")
        return train(args, console, t_start)
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
