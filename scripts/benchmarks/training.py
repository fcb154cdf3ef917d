"""The training benchmark's recipes (what every system trains) and rawgpu's timed run of one: warm up, re-initialise,
time the steps with CUDA events; one rank's run on several GPUs, and a step timed alone."""

from __future__ import annotations

import numpy as np

from rawgpu.runtime import driver as drv
from rawgpu.model.recipe import DEFAULTS, OPTIMIZER_DEFAULTS, Recipe
from .timing import time_graph

HIDDEN = (128, 256, 512, 1024, 2048, 4096, 8192)  # the widths the benchmark times unless told others
OPTIMIZER_KEYS = ("optimizer", "lr", "momentum", "nesterov", "beta1", "beta2", "eps", "weight_decay")

# The recipes the benchmark offers: what each system trains (steps: the run's length unless --steps is given).
RECIPES = {
    "seed": dict(batch=32, optimizer="sgd", lr=0.003, momentum=0.0, schedule="constant", steps=5000),
    "default": {**{k: getattr(Recipe(), k) for k in ("batch", "schedule") + OPTIMIZER_KEYS},  # the CLI's own
                "epochs": DEFAULTS["epochs"]},
    "adam": dict(batch=128, optimizer="adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 schedule="cosine", epochs=8),
}


def with_optimizer(recipe: dict, optimizer: str) -> dict:
    """`recipe` trained with another optimiser: its lr and weight decay become that optimiser's defaults (the CLI's:
    recipe.OPTIMIZER_DEFAULTS), its other settings keep theirs."""
    if optimizer == recipe.get("optimizer", "sgd"):
        return dict(recipe)
    out = {k: v for k, v in recipe.items() if k not in OPTIMIZER_KEYS}
    return {**out, "optimizer": optimizer, **OPTIMIZER_DEFAULTS[optimizer]}


def rawgpu_recipe(h: int | tuple[int, ...], r: dict, steps: int, seed: int) -> Recipe:
    """The rawgpu Recipe of a benchmark recipe at width h (784-h-h-h-10), or of the hidden widths h (a width per
    layer), over `steps` steps."""
    return Recipe(hidden=h, layers=3 if isinstance(h, int) else None, batch=r["batch"], schedule=r["schedule"],
                  total_steps=steps, seed=seed, activation=r.get("activation", DEFAULTS["activation"]),
                  **{k: r[k] for k in OPTIMIZER_KEYS if k in r})


def describe(r: dict) -> str:
    """The recipe as the header line writes it."""
    rr = rawgpu_recipe(256, r, 1, 0)
    act = "" if rr.activation == DEFAULTS["activation"] else f", {rr.activation}"
    return f"batch {r['batch']}, {rr.optimizer_text}, lr {r['lr']:g} {r['schedule']}{act}"


def bench_rawgpu(h: int, steps: int, seed: int, data, device_index: int, warmup: int = 50, step_kind: str = "auto",
                 steps_per_launch: int = 1, fused_grid: int | None = None, l2_budget: float | None = None,
                 recipe: dict | None = None) -> dict:
    """The reference workload on rawgpu: warm up (graph capture, first launches), re-initialise, then time `steps`
    steps, `steps_per_launch` per graph launch; GPU time summed over epochs (the per-epoch shuffle upload is not
    timed). step_kind: the step kind ("auto", "cluster", "fused", "layered", or "serial": the default step without
    programmatic dependent launch; "long": the layered step without its short form, one kernel per layer and
    role; "chain": the default step with every launch in one chain, no side streams); fused_grid: blocks of the
    fused step (None: one per SM); l2_budget: the share of the L2 the layered step's cache hints may keep per weight
    (None: the default); recipe: batch, optimiser and schedule (default RECIPES["seed"]'s), the schedule running over
    `steps`. Returns a dict with system, us_per_step, test_accuracy, nodes, step_kind, parameters, init (the initial
    parameters, for the peers) and note."""
    from rawgpu.training.session import Session
    from rawgpu.steps import StepOptions

    recipe = rawgpu_recipe(h, {**RECIPES["seed"], **(recipe or {})}, steps, seed)
    serial = step_kind == "serial"  # the default step, each kernel launched only when the one before has finished
    long = step_kind == "long"  # the layered step as it runs where its short form does not
    chain = step_kind == "chain"  # the default step without side streams
    budget = {} if l2_budget is None else {"l2_budget": l2_budget}
    options = StepOptions(overlap=not serial, short=not long, branches=not chain, fused_grid=fused_grid, **budget)
    kind = "auto" if serial or chain else "layered" if long else step_kind
    session = Session(recipe, device_index, step_kind=kind, options=options)
    if session.compile_seconds:
        print(f"# H={h} {step_kind}: {session.compile_note}", flush=True)
    us, accuracy, nodes, init, k = timed_run(session, steps, seed, data, warmup, steps_per_launch)
    session.model.step.close()
    session.model.arena.close()
    how = session.step_description + (f", {k} steps per launch" if k > 1 else "")
    name = "rawgpu" if step_kind == "auto" else f"rawgpu-{step_kind}"
    name += "" if l2_budget is None else f"-l2={l2_budget:g}"
    return dict(system=name, us_per_step=us, test_accuracy=accuracy, nodes=nodes,
                step_kind=session.model.kind,
                parameters=recipe.parameters, init=init, note=f"{nodes} graph node(s) per step; {how}")


def timed_run(session, steps: int, seed: int, data, warmup: int, steps_per_launch: int,
              scaling: tuple | None = None) -> tuple:
    """The session's model trained as the benchmark times it: warm up (graph capture, first launches),
    re-initialise, then `steps` steps, `steps_per_launch` per graph launch, the GPU time summed over epochs (the
    per-epoch shuffle upload is not timed); then the test set. Each epoch is a permutation of the recipe's
    train_rows. scaling: a table's (features' (mean, inv_std) or None, a regression's targets' (mean, scale) or
    None), as benchmarks.tables.scalings computes them; None: neither (MNIST). Returns (us per step, test accuracy
    (NaN for a regression: model.eval_errors() has its errors), graph nodes per step, the initial parameters, steps
    per launch)."""
    model, stream, recipe = session.model, session.stream, session.model.recipe
    features, targets = scaling or (None, None)
    if targets is not None:
        model.set_target_scaling(*targets)  # before the upload: the targets go up standardized
    model.upload_data(data)
    if features is not None:
        model.set_scaling(*features)
    rows = recipe.train_rows
    spe = recipe.steps_per_epoch
    graph = session.capture_step(1)
    k = max(1, min(steps_per_launch, spe))
    multi = session.capture_step(k) if k > 1 else None
    rng = np.random.default_rng(seed)
    model.init_parameters(stream)
    model.set_permutation(rng.permutation(rows))
    for _ in range(warmup):
        graph.launch(stream)
    model.init_parameters(stream)  # same init, step counter 0: the timed run trains exactly `steps` steps
    init = model.parameters()
    rng = np.random.default_rng(seed)
    total_ms, done, start, end = 0.0, 0, drv.Event(), drv.Event()
    while done < steps:
        model.set_permutation(rng.permutation(rows))
        n = min(spe, steps - done)
        session.sync_ranks()
        start.record(stream)
        for _ in range(n // k if multi else 0):
            multi.launch(stream)
        for _ in range(n % k if multi else n):
            graph.launch(stream)
        end.record(stream)
        total_ms += start.elapsed_ms(end)
        done += n
    start.close()
    end.close()
    for launch in model.eval_launches():
        launch.run(stream)
    _, accuracy = model.eval_metrics()
    nodes = len(graph.nodes())
    graph.close()
    if multi:
        multi.close()
    return total_ms * 1e3 / steps, accuracy, nodes, init, k


class _Nothing:
    """An all-reduce left out: the step of a rank without its collectives (bench_rank)."""

    def run(self, stream) -> None:
        pass

    def overlapping(self) -> "_Nothing":
        return self


class NoSums:
    """A rank's communicator whose all-reduces do nothing: a rank's step timed without its collectives."""

    def all_reduce(self, send, recv, count) -> _Nothing:
        return _Nothing()


def step_alone_us(model, stream, steps: int, trials: int, data) -> float:
    """Median us per step of a freshly allocated model's step on `data` (the recipe's dataset) from its initial
    parameters, `steps` to a graph, without evaluation. Real values, not the zeroed arena's: where the GPU runs at its
    power limit, the time depends on them (docs/perf.md: Power)."""
    model.upload_data(data)
    model.init_parameters(stream)
    model.set_permutation(np.random.default_rng(model.recipe.seed).permutation(model.recipe.train_rows))
    launches = model.step_launches(steps)
    return time_graph(stream, lambda: [launch.run(stream) for launch in launches], steps, trials)


def bench_rank(rank: int, ranks: int, unique_id: bytes, h: int, steps: int, seed: int, data, recipe: dict,
               steps_per_launch: int = 100, warmup: int = 50, mode: str = "auto") -> dict:
    """One rank of the recipe's model on `ranks` GPUs, split as `mode` says (steps.MODES; a process of
    runtime.ranks.run_ranks, or called alone with ranks 1): the run timed as bench_rawgpu times it, and the same rank's step
    with its all-reduces left out, timed in a graph of steps_per_launch steps (the difference is the step's time in
    its collectives, waits included)."""
    from rawgpu.runtime.ranks import Rank
    from rawgpu.training.session import Session
    from rawgpu.steps import StepOptions, plan_model

    recipe = rawgpu_recipe(h, {**RECIPES["seed"], **recipe}, steps, seed)
    session = Session(recipe, rank=Rank(ranks, rank, unique_id, mode))
    try:
        us, accuracy, nodes, _, k = timed_run(session, steps, seed, data, warmup, steps_per_launch)
        alone = plan_model(recipe, session.choice, kernels=session.kernels, sm_count=session.device.sm_count,
                           options=StepOptions(l2_bytes=session.device.l2_bytes), rank=rank,
                           group=NoSums()).allocate()
        try:
            without = step_alone_us(alone, session.stream, k, 10, data)
        finally:
            alone.arena.close()
        return dict(rank=rank, us_per_step=us, us_without_sums=without, test_accuracy=accuracy, nodes=nodes,
                    split=session.choice.kind, note=session.step_description)
    finally:
        session.close()


def bench_rawgpu_models(recipes: list, steps: int, data, device_index: int) -> dict:
    """A sweep's models trained together (the models step, stack_trainer.py) for `steps` steps, as Sweep.fit runs
    them: us per step of all N (CUDA events around the steps' graph launches, evaluation excluded; the first
    epoch's graph launches warm it up as a user's run does) and each model's test accuracy."""
    from rawgpu.training.stack_trainer import StackTrainer, stack_recipes

    with StackTrainer(stack_recipes(recipes, data, None, steps), data, device=device_index) as trainer:
        histories = trainer.fit()
    seconds = sum(h.seconds for h in histories[0])
    return dict(us_per_step=seconds / steps * 1e6, accuracies=[h[-1].test_accuracy for h in histories])
