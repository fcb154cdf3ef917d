"""A width per hidden layer (issue 46): the recipe's rule (one width for --layers layers, or a list that sets the
count; a list of one width for all is that width), the CLIs' bad input in one line before any GPU work, which step
kinds take such a model, and a checkpoint that keeps it. The GPU checks of such models against float64 are in
test_widths_gpu below."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rawgpu.training import checkpoint as ck
from rawgpu import steps
from rawgpu.cli import train
from rawgpu.cli import sweep as sweep_cli
from rawgpu.model.recipe import MAX_WIDTH_LIST, Recipe, hidden_of
from test_checkpoint import make

gpu = pytest.mark.gpu


def test_a_width_list_sets_the_layers_and_names_the_model():
    r = Recipe(hidden=(1024, 512, 256))
    assert (r.layers, r.hidden_widths, r.uniform) == (3, (1024, 512, 256), False)
    assert r.widths == [784, 1024, 512, 256, 10] and r.name == "784-1024-512-256-10"
    assert r._padded_widths == [784, 1024, 512, 256, 16] and r.hidden_label == "1024-512-256"
    assert r.parameters == 784 * 1024 + 1024 + 1024 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    # one width for every layer is that width: one recipe, one name for one model
    assert Recipe(hidden=[256, 256, 256]) == Recipe(hidden=256) == Recipe(hidden=256, layers=3)
    assert (Recipe(hidden=(100,)).hidden, Recipe(hidden=(100,)).layers) == (100, 1)
    assert Recipe(hidden=300, layers=2).hidden_widths == (300, 300)


@pytest.mark.parametrize("kw, message", [
    (dict(hidden=(0, 512)), "hidden: must be >= 1, got 0"),
    (dict(hidden=()), "hidden: needs at least one width"),
    (dict(hidden=(64,) * (MAX_WIDTH_LIST + 1)), f"at most {MAX_WIDTH_LIST} widths"),
    (dict(hidden=(512, 256), layers=3), "a width list sets the layer count: 2 widths, layers 3"),
    (dict(hidden=(512, 2.5)), "hidden: must be an integer >= 1, got 2.5"),
])
def test_bad_width_lists_say_why(kw, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kw)


def test_the_clis_width_lists_and_their_bad_input():
    assert hidden_of([512], None) == (512, 3) and hidden_of([512], 5) == (512, 5)
    assert hidden_of([1024, 512], None) == ((1024, 512), 2)
    with pytest.raises(ValueError, match="argument --layers: a width list sets the layer count"):
        hidden_of([1024, 512], 2)
    args = train.build_parser().parse_args(["--hidden", "1024", "512", "256"])
    recipe = train.make_recipe(args, train.make_plan(args))
    assert recipe.hidden == (1024, 512, 256) and recipe.layers == 3


@pytest.mark.parametrize("tool, argv, message", [
    (train, ["--hidden", "0", "512"], "argument --hidden: must be >= 1, got 0"),
    (train, ["--hidden", "512", "256", "--layers", "2"], "argument --layers: a width list sets the layer count"),
    (train, ["--hidden", *["64"] * 17], f"argument --hidden: at most {MAX_WIDTH_LIST} widths"),
    (sweep_cli, ["--hidden", "512", "256", "--layers", "4"], "argument --layers: a width list sets the layer count"),
])
def test_bad_widths_on_the_command_line_are_one_line_and_exit_2(tool, argv, message, capsys, monkeypatch):
    monkeypatch.setattr("rawgpu.runtime.driver.init", lambda: pytest.fail("the GPU was opened"))
    with pytest.raises(SystemExit) as exc:
        tool.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and message in err[-1], err


def test_which_kinds_take_a_funnel_and_why_not():
    funnel = Recipe(hidden=(512, 256, 128), batch=32, momentum=0.0)
    choice = steps.choose(funnel, "sm_90", "auto")
    why = choice.passed_over
    assert "the cluster step keeps one width for every hidden layer, not 512-256-128" in why.values()
    for arch in ("sm_86", "sm_90"):
        model = steps.plan_model(funnel, arch=arch)
        assert [lay.w16.shape for lay in model.layers] == [(784, 512), (512, 256), (256, 128), (128, 16)]
        assert model.acts[2].shape == (32, 256) and model.eval_h[0].shape[1] == 512
    stack = steps.plan_model(funnel, arch="sm_90", models=[funnel, funnel])
    assert [p.IN for p in stack.step.bwd if p is not None] == [784, 512, 256]


def test_a_checkpoint_keeps_a_width_list(rng, tmp_path):
    recipe = Recipe(hidden=(24, 16, 40), batch=10, inputs=12, classes=5, train_rows=100, test_rows=30)
    path = ck.save(tmp_path / "f.safetensors", make(rng, recipe))
    loaded = ck.load(path)
    assert loaded.recipe == recipe and loaded.recipe.hidden == (24, 16, 40)
    assert [w.shape for w, _ in loaded.weights] == [(12, 24), (24, 16), (16, 40), (40, 5)]
    meta = json.loads(json.dumps(recipe.to_dict()))
    assert Recipe.from_dict(meta) == recipe
    with pytest.raises(ValueError, match="bad value"):
        Recipe.from_dict({**meta, "hidden": [24, "16"]})
    assert isinstance(np.asarray(loaded.weights[1][0]), np.ndarray)


def test_the_tensor_parallel_plan_shards_each_layer_by_its_own_width():
    from rawgpu.steps.split import plan_tensor_parallel

    r = Recipe(hidden=(1024, 520, 256))
    plan = plan_tensor_parallel(r.widths, r.batch, 2)
    assert plan.widths == (784, 1024, 528, 256, 10)  # 520 in shards of 264 (padded to 8) per rank
    assert [(s.split, s.fan_in, s.fan_out) for s in plan.shards] == [
        ("columns", 784, 512), ("rows", 512, 528), ("columns", 528, 128), ("rows", 128, 10)]
