"""The step kinds and their one chooser (rawgpu/steps/), and the recipe's one statement of defaults and limits
(rawgpu/model/recipe.py): plain Python, tested on CPU."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from rawgpu.model import optimizer
from rawgpu.contract import OPTIM_WORDS
from rawgpu.model import recipe as rc
from rawgpu import steps
from rawgpu.cli import train
from rawgpu.runtime.errors import StepUnsupported
from rawgpu.kernels.elementwise import BIAS_SPLIT_ROWS
from rawgpu.steps import StepOptions, plan_model
from rawgpu.model.recipe import Recipe
import kernel_params  # beside this file: the kernels' parameters, read from their declarations

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = (dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.0, weight_decay=1e-4), dict(optimizer="adam"))
RECIPES = [Recipe(hidden=h, layers=layers, batch=b, accum=acc, **opt)
           for h, layers, b, opt, acc in itertools.product((8, 100, 128, 256, 512, 513, 1024, 4096), (1, 3, 9),
                                                           (1, 32, 33, 128), OPTIMIZERS, ("fp32", "fp16"))]


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_every_recipe_has_a_step_on_every_arch(arch):
    """GPUs before sm_90 keep a complete path: every recipe gets a step that can run it there."""
    for r in RECIPES:
        choice = steps.choose(r, arch)
        assert choice.kind in steps.KINDS and choice.reason
        assert steps.unsupported_reason(choice.kind, r, arch) is None
        if arch != "sm_90":
            assert choice.kind in ("fused", "layered"), (r, choice)
        if not r._plain_sgd:  # the cluster step runs plain SGD only
            assert choice.kind != "cluster", (r, choice)
        short = arch == "sm_90" and r.accum == "fp32" and r.batch <= 256  # the short form runs every optimiser
        assert short == (choice.kind == "cluster" or "short" in choice.reason), (r, choice)


def test_auto_says_why_it_passed_every_kind_over():
    choice = steps.choose(Recipe(hidden=2048, batch=512), "sm_90")  # a batch past the short form, wide: 18 kernels
    assert choice.kind == "layered"
    assert list(choice.passed_over) == ["cluster", "layered (short form)", "fused"]
    assert "at most 32" in choice.passed_over["cluster"] and "batch 512 > 320" in choice.passed_over["fused"]
    assert "on warpgroup MMA" in choice.passed_over["fused"]
    before_sm90 = steps.choose(Recipe(hidden=2048, batch=512), "sm_86").passed_over["fused"]
    assert "hidden 2048 > 1024" in before_sm90 and "in 18 kernels" in before_sm90
    assert "batch <= 256" in choice.passed_over["layered (short form)"]
    # above the short form's batches on sm_90: the fused step up to batch 320 and 256 wide, warpgroup MMA beyond
    assert steps.choose(Recipe(hidden=256, batch=300), "sm_90").kind == "fused"
    wide = steps.choose(Recipe(hidden=512, batch=300), "sm_90")
    assert wide.kind == "layered" and "hidden 512 > 256" in wide.passed_over["fused"]
    for batch in (384, 512):
        large = steps.choose(Recipe(hidden=128, batch=batch), "sm_90")
        assert large.kind == "layered" and f"batch {batch} > 320" in large.passed_over["fused"]
        assert "on warpgroup MMA" in large.passed_over["fused"]
        assert steps.choose(Recipe(hidden=1024, batch=batch), "sm_86").kind == "fused"  # mma.sync tiles there
    for arch in ("sm_86", "sm_90"):  # above batch 512 the layered step's GEMM tiles win at every width
        large = steps.choose(Recipe(hidden=128, batch=1024), arch)
        assert large.kind == "layered" and "batch 1024 > 512" in large.passed_over["fused"]
    assert "hidden 1024 > 512" in steps.choose(Recipe(hidden=1024, batch=32, momentum=0.0), "sm_86").passed_over["fused"]
    for r in (Recipe(hidden=2048, batch=128), Recipe(hidden=256, optimizer="adam"), Recipe(hidden=128, batch=256)):
        assert "short form" in steps.choose(r, "sm_90").reason
    assert choice.explain().splitlines()[0].startswith("layered: ")
    assert steps.choose(Recipe(hidden=128, batch=32, momentum=0.0), "sm_90").passed_over == {}


@pytest.mark.parametrize("kind,changes,arch,reason", [
    ("cluster", {}, "sm_86", "sm_90 or newer"), ("cluster", dict(hidden=256, batch=32, momentum=0.0), "sm_90",
                                                 "does not fit"),
    ("fused", dict(accum="fp16"), "sm_90", "fp32 only"), ("fused", dict(layers=64), "sm_86", None),
    ("layered", dict(accum="fp16", batch=60000), "sm_80", None)])
def test_a_named_kind_runs_or_says_why(kind, changes, arch, reason):
    r = Recipe(**changes)
    if reason is None:
        assert steps.choose(r, arch, kind) == steps.Choice(kind, "asked for by name")
        return
    with pytest.raises(StepUnsupported, match=reason) as info:
        steps.choose(r, arch, kind)
    assert str(info.value).startswith(f"{kind} cannot run this recipe: ") and "\n" not in str(info.value)


def test_the_model_takes_the_chosen_step_and_plans_only_its_buffers():
    for r, arch in [(Recipe(hidden=128, batch=32, momentum=0.0), "sm_90"), (Recipe(), "sm_86"),
                    (Recipe(hidden=2048), "sm_90"), (Recipe(hidden=2048, accum="fp16"), "sm_86")]:
        model = plan_model(r, arch=arch)
        assert model.kind == steps.choose(r, arch).kind == model.step.kind
        names = set(model.arena.tensors)
        assert ("fused_params" in names) == (model.kind == "fused")
        assert ("cluster_params" in names) == (model.kind == "cluster")
        assert ("w16b_0" in names) == (model.kind == "fused")


def test_the_step_option_help_is_the_choosers_own_words_in_every_cli():
    text = steps.help_text()
    for kind in steps.ONE_GPU:
        assert f"{kind}: {steps.KINDS[kind].SUMMARY}" in text
    assert "hidden <= 1024, or <= 512 at batch <= 32" in text  # the fused step's limits, from steps/fused.py
    spec = importlib.util.spec_from_file_location("inspect_graph", ROOT / "scripts" / "inspect_graph.py")
    inspect_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect_graph)
    squash = lambda s: " ".join(s.split())  # noqa: E731 - argparse wraps help text
    for parser in (train.build_parser(), inspect_graph.build_parser()):
        assert squash(text) in squash(parser.format_help())


def test_the_parser_defaults_are_the_recipe_defaults():
    args = train.build_parser().parse_args([])
    for name, option in rc.OPTIONS.items():  # the optimiser-dependent ones stay unset: Recipe resolves them
        assert getattr(args, name) == (None if name in rc.UNSET_UNLESS_GIVEN else option.default)
        assert option.default == rc.DEFAULTS[name]
    recipe = train.make_recipe(args, train.make_plan(args))
    assert (recipe.hidden, recipe.layers, recipe.batch, recipe.lr, recipe.momentum, recipe.schedule,
            recipe.warmup_steps, recipe.accum, recipe.seed) == (
        Recipe().hidden, Recipe().layers, Recipe().batch, Recipe().lr, Recipe().momentum, Recipe().schedule,
        Recipe().warmup_steps, Recipe().accum, Recipe().seed)
    assert recipe.total_steps == 8 * (60000 // 128)


@pytest.mark.parametrize("changes,message", [
    (dict(hidden=0), "hidden: must be >= 1, got 0"), (dict(layers=65), "layers: must be <= 64, got 65"),
    (dict(batch=60001), "batch: must be <= 60000"), (dict(lr=0.0), "lr: must be > 0"),
    (dict(momentum=1.0), "momentum: must be <= 0.999"), (dict(schedule="steep"), "schedule: must be one of"),
    (dict(accum="bf16"), "accum: must be one of fp32, fp16"), (dict(warmup_steps=-1), "warmup_steps: must be >= 0"),
    (dict(lr=float("nan")), "lr: must be finite"), (dict(optimizer="lion"), "optimizer: must be one of sgd, adam"),
    (dict(optimizer="adam", beta2=1.0), "beta2: must be <= 0.999999"), (dict(optimizer="adam", eps=0.0), "eps: must be > 0"),
    (dict(weight_decay=-0.1), "weight_decay: must be >= 0"), (dict(nesterov=True, momentum=0.0), "nesterov: needs"),
    (dict(optimizer="adam", nesterov=True), "nesterov: applies to optimizer sgd, not adam"),
    (dict(optimizer="adam", momentum=0.5), "^momentum: applies to optimizer sgd, not adam; leave it unset \\(None\\)$"),
    (dict(optimizer="adamw", momentum=0.9), "^momentum: applies to optimizer sgd, not adamw"),
    (dict(beta1=0.5), "^beta1: applies to optimizer adam and adamw, not sgd$"),
    (dict(eps=1e-6), "^eps: applies to optimizer adam and adamw, not sgd$"),
    (dict(inputs=0), "^inputs: must be >= 1, got 0$"), (dict(classes=1001), "^classes: must be <= 1000, got 1001$"),
    (dict(total_steps=-1), "^total_steps: must be >= 0, got -1$"), (dict(test_rows=0), "^test_rows: must be >= 1")])
def test_the_recipe_checks_the_same_limits_as_the_cli(changes, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**changes)


def test_loss_scaled_learning_rate_and_padding_are_stated_once():
    r = Recipe(batch=128, lr=0.05, lr_min=0.001)
    assert rc.loss_scale(128) == 16 * 128 and rc.loss_scale(129) == 16 * 256 and rc.loss_scale(1) == 16
    assert r._scaled_lr == (0.05 / rc.loss_scale(128), 0.001 / rc.loss_scale(128))
    assert r._padded_widths == [784, 256, 256, 256, 16]
    assert Recipe(hidden=100)._padded_widths == [784, 104, 104, 104, 16]
    assert rc.cdiv(7, 2) == 4 and rc.pad8(9) == 16
    assert [rc.padded_classes(c) for c in (2, 10, 16, 17, 100, 1000)] == [16, 16, 16, 24, 104, 1000]
    assert r._kernel_accum == "f32" and r._schedule_code == rc.SCHEDULES["cosine"]


def test_each_optimiser_resolves_its_defaults_and_counts_its_state():
    sgd, adam, adamw = Recipe(), Recipe(optimizer="adam"), Recipe(optimizer="adamw")
    assert (sgd.lr, sgd.momentum, sgd.weight_decay, sgd._state_tensors) == (0.05, 0.9, 0.0, 1)
    assert (adam.lr, adam.weight_decay, adam._state_tensors, adam.beta1, adam.beta2, adam.eps) == (1e-3, 0.0, 2, 0.9,
                                                                                                   0.999, 1e-8)
    assert (adamw.lr, adamw.weight_decay) == (1e-3, 0.01) and Recipe(optimizer="adam", lr=0.01).lr == 0.01
    assert Recipe(momentum=0.0)._plain_sgd and not Recipe(momentum=0.0, weight_decay=1e-4)._plain_sgd
    assert not adam._plain_sgd and not adam._uses_momentum and Recipe(momentum=0.0)._state_tensors == 0
    weights = sum(a * b for a, b in zip(adam.widths, adam.widths[1:]))
    assert adam._step_bytes() == 26 * weights and sgd._step_bytes() == 18 * weights
    assert sgd.optimizer_text == "SGD with momentum 0.9"
    assert Recipe(momentum=0.5, nesterov=True, weight_decay=0.1).optimizer_text == \
        "SGD with Nesterov momentum 0.5, weight decay 0.1"
    assert adamw.optimizer_text == "AdamW (betas 0.9, 0.999, eps 1e-08, weight decay 0.01)"
    assert optimizer.state_names(sgd) == ("momentum",) and optimizer.state_names(Recipe(momentum=0.0)) == ()
    assert optimizer.state_names(adamw) == ("exp_avg", "exp_avg_sq")


def test_the_optimiser_table_scales_what_meets_scaled_gradients():
    """Gradients arrive times the loss scale S: SGD's lr and the L2 term are divided and multiplied by it, Adam's eps
    is multiplied (its moments hold S m and S^2 v); AdamW's decay and the bias corrections are unscaled."""
    s = rc.loss_scale(128)
    o = optimizer.hyperparameters(Recipe(momentum=0.9, nesterov=True, weight_decay=1e-3))
    assert (o.kind, o.nesterov, o.l2, o.wd) == (0, 1, pytest.approx(1e-3 * s), 0.0)
    assert o.lr == pytest.approx(0.05 / s) and o.beta1 == pytest.approx(0.9)
    a = optimizer.hyperparameters(Recipe(optimizer="adamw", weight_decay=0.1))
    assert (a.kind, a.eps, a.l2, a.wd, a.scale) == (2, pytest.approx(1e-8 * s), 0.0, pytest.approx(0.1), s)
    assert (a.m_rate, a.v_rate) == (pytest.approx(0.1), pytest.approx(0.001))
    for step in (0, 1, 9, 999):
        t = optimizer.step_values(a, step, 1e-3 / s)
        assert t.step_size == pytest.approx(1e-3 / (1 - 0.9 ** (step + 1)), rel=1e-7)
        assert t.bias2 == pytest.approx((1 - 0.999 ** (step + 1)) ** -0.5, rel=1e-7)
        assert t.decay_rate == pytest.approx(1e-3 * 0.1, rel=1e-7) and t.lr == pytest.approx(1e-3 / s)
    assert optimizer.words(a).shape == (OPTIM_WORDS,) and optimizer.words(a).dtype == "float32"


def _tables_by_name(kind: str, recipe: Recipe) -> list[str]:
    """A step's parameter table with every device address replaced by the name of the arena buffer it points to."""
    model = plan_model(recipe, kind, arch="sm_90")
    model.arena.base, model.arena._allocated = 1 << 40, True  # addresses without a GPU
    names = {t.ptr: t.name for t in model.arena}
    return [names.get(int(w), hex(int(w))) for w in model.step.param_table()]


def test_parameter_tables_point_each_field_at_its_buffer():
    words = _tables_by_name("fused", Recipe(hidden=192, layers=2, batch=48, momentum=0.9, total_steps=40))
    assert words[:12] == ["train_images", "train_labels", "perm", "step", "loss_sum", "correct", "row_loss",
                          "row_hit", "grid_barrier", "0x30", hex(60000 // 48), "0x3"]
    assert len(words) == 28 + 3 * 14  # words 19..27: the optimiser, by value
    assert words[28:42] == ["wlo_0", "w16_0", "w16b_0", "b_0", "mw_0", "mb_0", "0x0", "0x0", "act0", "act1", "grad1",
                            "0x0", hex(784), hex(192)]
    assert words[-14:] == ["wlo_2", "w16_2", "w16b_2", "b_2", "mw_2", "mb_2", "0x0", "0x0", "act2", "0x0", "grad3",
                           "grad2", hex(192), hex(16)]
    words = _tables_by_name("fused", Recipe(hidden=192, layers=2, batch=48, optimizer="adam", total_steps=40))
    assert words[28:36] == ["wlo_0", "w16_0", "w16b_0", "b_0", "mw_0", "mb_0", "vw_0", "vb_0"]
    words = _tables_by_name("cluster", Recipe(hidden=128, layers=3, batch=32, momentum=0.0))
    assert words[:8] == ["train_images", "train_labels", "perm", "step", "loss_sum", "correct", "0x20", hex(60000 // 32)]
    assert len(words) == 27 + 4 * 8 and words[27:32] == ["wlo_0", "w16_0", "b_0", hex(784), hex(128)]


class _Bound(tuple):
    """What _BindingKernels' bind returns: (kernel name, packed args, side stream's name or None, joined sides' names),
    placed as driver.Launch places a launch."""

    def beside(self, side):
        return _Bound((self[0], self[1], side.name, self[3]))

    def after(self, *sides):
        return _Bound((*self[:3], self[3] + tuple(s.name for s in sides)))


class _BindingKernels:
    """Kernels that bind without a GPU: each launcher's checks and argument packing run, nothing is loaded."""

    def __init__(self, arch: str, activation: str = "relu"):
        self.arch, self.activation, self.facts = arch, activation, {}

    def get(self, source: str, name: str):
        from rawgpu.runtime.driver import PackedArgs

        signature = kernel_params.signature(source, name)

        class Bound:
            def bind(self, grid, block, smem, *args, **kw):
                return _Bound((name, PackedArgs(signature, args), None, ()))

            def max_blocks_per_sm(self, threads, smem):  # as an SM of 228 KB would hold them
                return min(2048 // threads, 228 * 1024 // (smem + 1024))
        return Bound()


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_the_layered_step_counts_its_kernels_without_binding_them(arch, monkeypatch):
    """describe() is asked for after a run too, when the arena is gone: the count comes from the plans alone."""
    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))  # the driver encodes these
    for r in (Recipe(hidden=256, batch=32, momentum=0.0), Recipe(), Recipe(hidden=100, layers=1, accum="fp16"),
              Recipe(hidden=4096, batch=32, momentum=0.0, layers=5), Recipe(hidden=512, optimizer="adamw"),
              Recipe(hidden=100, batch=256, momentum=0.9, nesterov=True, weight_decay=1e-4)):
        model = plan_model(r, "layered", arch=arch)
        model.arena.base, model.arena._allocated = 1 << 40, True
        model.k = _BindingKernels(arch)
        count = len(model.step._one_step())
        assert model.step.kernel_count() == count
        model.arena._allocated = False  # as after arena.close()
        assert model.step.describe().startswith(f"layered: {count} kernels")
    assert plan_model(Recipe(hidden=256, batch=32, momentum=0.0), arch="sm_90").step.kernel_count() == 8
    assert plan_model(Recipe(hidden=1024), "layered", arch="sm_90").step.kernel_count() == 8
    assert plan_model(Recipe(hidden=1024, optimizer="adam"), arch="sm_90").step.kernel_count() == 8
    # the long form: the head's forward with the loss in one launch (logits_xent) from a layer up to 512 wide, else 18
    assert plan_model(Recipe(hidden=512), "layered", arch="sm_86").step.kernel_count() == 17
    assert plan_model(Recipe(hidden=512, batch=512), "layered", arch="sm_90").step.kernel_count() == 17
    assert plan_model(Recipe(hidden=1024), "layered", arch="sm_86").step.kernel_count() == 18
    assert plan_model(Recipe(hidden=1024, batch=512), "layered", arch="sm_90").step.kernel_count() == 18
    # the width that counts is the layer under the head's
    assert plan_model(Recipe(hidden=[1024, 512], batch=512), "layered", arch="sm_90").step.kernel_count() == 13
    assert plan_model(Recipe(hidden=[512, 1024], batch=512), "layered", arch="sm_90").step.kernel_count() == 14
    apart = StepOptions(fuse_loss=False)
    assert plan_model(Recipe(hidden=512, batch=512), "layered", arch="sm_90", options=apart).step.kernel_count() == 18
    regression = Recipe(hidden=512, batch=512, inputs=784, classes=1, loss="mse")  # no softmax to fuse
    assert plan_model(regression, "layered", arch="sm_90").step.kernel_count() == 18


@pytest.mark.parametrize("arch,recipe", [("sm_90", Recipe(hidden=256, batch=1024)),
                                         ("sm_90", Recipe(hidden=1000, batch=600, optimizer="adam", layers=2)),
                                         ("sm_86", Recipe(hidden=512)), ("sm_80", Recipe(hidden=100, accum="fp16"))])
def test_outside_the_short_form_the_updates_run_beside_the_chain(arch, recipe, monkeypatch):
    """Every layer's dW GEMM with its update runs on the weights' side stream (the first layer's on a side of its
    own) and its bias update on the biases', forked where their inputs are ready: the bias update right after the
    launch that wrote its dy (before the layer's dx GEMM), the dW GEMM right after the dx GEMM, which reads W16 before
    the update rewrites it; the step counter joins every side; no launch of a side touches the chain's split-K or
    exact-sum scratch, nor one of the chain a side's, and the two weight sides' split-K scratch is apart.
    StepOptions(branches=False) keeps every launch in the chain."""
    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    for branches in (True, False):
        model = plan_model(recipe, "layered", arch=arch, options=StepOptions(branches=branches))
        model.arena.base, model.arena._allocated = 1 << 40, True
        model.k = _BindingKernels(arch)
        step = model.step._one_step()
        names, sides = [b[0] for b in step], [b[2] for b in step]
        dw = [i for i, n in enumerate(names) if "_cr_" in n]
        bias = [i for i, n in enumerate(names) if n == "bias_update"]
        dx = [i for i, n in enumerate(names) if "_rc_" in n]
        assert len(dw) == len(bias) == len(dx) + 1 == recipe.layers + 1, names
        if not branches:
            assert sides == [None] * len(step) and step[-1][3] == (), step
            continue
        first = "first layer's weight update"
        assert [sides[i] for i in dw] == ["weight updates"] * recipe.layers + [first], names  # top down
        assert {sides[i] for i in bias} == {"bias updates"}
        assert all(s is None for i, s in enumerate(sides) if i not in dw + bias), sides
        fused = recipe._padded_widths[-2] <= 512  # the head's forward and the loss in one launch (logits_xent)
        loss = names.index("logits_xent" if fused else "softmax_xent")
        writes_dy = [loss] + dx  # the chain's launch that writes each layer's dy, top down
        forked_after = lambda i: max(j for j in range(i) if sides[j] is None)  # noqa: E731 - the chain's launch before
        for layer, (b, w) in enumerate(zip(bias, dw)):
            assert forked_after(b) == writes_dy[layer], names  # the bias forks as soon as its dy is there
            # the dW GEMM forks after its dx GEMM has read W16 (the first layer's, which has none, after its dy)
            assert forked_after(w) == (dx[layer] if layer < len(dx) else writes_dy[layer]), names
        assert names[-1] == "step_increment" and set(step[-1][3]) == {"weight updates", first, "bias updates"}
        addresses = lambda b: {getattr(v, "value", None) for v in b[1].values}  # noqa: E731 - its packed args
        side_scratch = {t.ptr for t in model.step.sides.counters()}
        chain_scratch = {t.ptr for t in (model.workspace, model.tickets, model.exact_sums, model.exact_tickets)}
        for b, side in zip(step, sides):
            assert not addresses(b) & (chain_scratch if side else side_scratch), (b[0], side)
        splitk = {side.name: {t.ptr for t in pair} for side, pair in model.step.sides.splitk.items()}
        for i in dw:  # the first layer's dW GEMM runs beside the second's: neither touches the other's split-K scratch
            assert not addresses(step[i]) & splitk["weight updates" if sides[i] == first else first], names[i]
        if recipe.batch > BIAS_SPLIT_ROWS:  # the bias updates' row ranges meet in exact sums
            assert all(addresses(step[i]) & side_scratch for i in bias), "a bias update without its side's sums"


@pytest.mark.parametrize("classes", [17, 100, 1000])
def test_more_classes_than_one_head_tile_run_the_layered_steps_head_as_kernels(classes, monkeypatch):
    """Above 16 classes the head is a GEMM over the padded classes and softmax_xent: the layered step's long head,
    on every arch; auto passes the fused and cluster steps over, saying why; every launch binds on the CPU."""
    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    recipe = Recipe(hidden=512, batch=128, classes=classes)
    assert recipe._padded_widths[-1] == rc.padded_classes(classes) >= classes
    for arch in ("sm_86", "sm_90"):
        choice = steps.choose(recipe, arch, "auto")
        assert choice.kind == "layered", choice
        assert f"one tile of 16 classes, not {classes}" in choice.passed_over["fused"]
        model = plan_model(recipe, "layered", arch=arch)
        assert model.step.head is None, "no one-cluster head past 16 classes"
        model.arena.base, model.arena._allocated = 1 << 40, True
        model.k = _BindingKernels(arch)
        names = [b[0] for b in model.step._one_step()]
        assert "softmax_xent" in names and len(names) == model.step.kernel_count(), names
