"""A sweep's grid (rawgpu/training/grid.py): every model's recipe is a single run's recipe with its settings and seed; a bad
grid is one line before any GPU work."""

from __future__ import annotations

import pytest

from rawgpu.training.grid import Grid, check_sweep, describe_point, parse_seeds
from rawgpu.model.recipe import Recipe


def test_every_model_is_the_base_recipe_with_its_point_and_seed():
    grid = Grid((("lr", (0.01, 0.05)), ("momentum", (0.0, 0.9))), seeds=(3, 4, 5))
    recipes = grid.recipes(Recipe(hidden=256))
    assert grid.models == len(recipes) == 12
    assert [(r.lr, r.momentum, r.seed) for r in recipes[:4]] == [(0.01, 0.0, 3), (0.01, 0.0, 4), (0.01, 0.0, 5),
                                                                  (0.01, 0.9, 3)]
    assert len({(r.lr, r.momentum, r.seed) for r in recipes}) == 12
    assert all(r.hidden == 256 and r.batch == 128 for r in recipes)  # one architecture, one batch
    assert recipes[0] == Recipe(hidden=256, lr=0.01, momentum=0.0, seed=3)  # as a single run builds it


def test_betas_warmup_and_schedule_set_their_fields():
    grid = Grid((("betas", ((0.9, 0.999), (0.8, 0.99))), ("warmup", (0, 50)), ("schedule", ("cosine", "constant"))))
    recipes = grid.recipes(Recipe(optimizer="adam"))
    assert (recipes[-1].beta1, recipes[-1].beta2, recipes[-1].warmup_steps, recipes[-1].schedule) == (
        0.8, 0.99, 50, "constant")


def test_the_size_line_says_what_trains_before_any_gpu_work():
    grid = Grid((("lr", (0.01, 0.02, 0.05, 0.1)),), seeds=tuple(range(8)))
    assert grid.size_line(Recipe(hidden=256)).startswith("32 models: 4 lr x 8 seeds, 784-256-256-256-10, batch 128, ")
    assert Grid().size_line(Recipe()).startswith("1 model: 1 seed, ")
    assert describe_point({"lr": 0.05, "betas": (0.9, 0.999), "seed": 3}) == "lr 0.05, betas 0.9/0.999, seed 3"


@pytest.mark.parametrize("texts, seeds", [(["0-7"], tuple(range(8))), (["3"], (3,)), (["0-2", "9"], (0, 1, 2, 9))])
def test_seeds_are_lists_or_ranges(texts, seeds):
    assert parse_seeds(texts) == seeds


@pytest.mark.parametrize("make, message", [
    (lambda: Grid((("lr", ()),)), "lr: the grid needs at least one value"),
    (lambda: Grid((("lr", (0.1, 0.1)),)), "lr: 0.1 is given twice"),
    (lambda: Grid((("lr", (0.1,)), ("lr", (0.2,)))), "lr is swept twice"),
    (lambda: Grid((("hidden", (128, 256)),)), "hidden cannot be swept: a sweep varies lr, momentum"),
    (lambda: Grid(seeds=()), "seeds: the grid needs at least one value"),
    (lambda: Grid(seeds=(-1,)), "seeds must be integers >= 0"),
    (lambda: parse_seeds(["0-3", "2"]), "seeds: 2 is given twice"),
    (lambda: parse_seeds(["7-3"]), "a seed range runs from a seed >= 0 up to a later one, got '7-3'"),
    (lambda: parse_seeds(["a"]), "seeds are integers or ranges such as 0-7, got 'a'"),
    (lambda: Grid((("momentum", (0.9,)),)).recipes(Recipe(optimizer="adam")),
     "momentum: applies to --optimizer sgd, not adam \\(swept\\)"),
    (lambda: Grid((("lr", (0.1, -1.0)),)).recipes(Recipe()), "model 1 \\(lr -1, seed 0\\): lr: must be"),
])
def test_a_bad_grid_is_one_line(make, message):
    with pytest.raises(ValueError, match=message) as exc:
        make()
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("make, kind, message", [
    (lambda: Grid(seeds=5), TypeError, "seeds: must be a list of integers >= 0, e.g. range(8), got 5"),
    (lambda: Grid(seeds="0-7"), TypeError, "seeds: must be a list of integers >= 0, e.g. range(8), got '0-7'"),
    (lambda: Grid(axes={"lr": 0.1}), TypeError, "axes: lr's values must be a list, got 0.1"),
    (lambda: Grid(axes=("lr", (0.1,))), TypeError, "axes: must be (setting, values) pairs, e.g. ((\"lr\", "
                                                   "(0.01, 0.1)),) or {\"lr\": [0.01, 0.1]}, got ('lr', (0.1,))"),
])
def test_a_grid_of_the_wrong_shape_is_one_line_naming_the_parameter(make, kind, message):
    with pytest.raises(kind) as info:
        make()
    assert str(info.value) == message


def test_a_grid_takes_a_dict_of_lists_and_ranges():
    grid = Grid(axes={"lr": [0.1, 0.2], "momentum": (0.0, 0.9)}, seeds=range(3))
    assert grid == Grid((("lr", (0.1, 0.2)), ("momentum", (0.0, 0.9))), (0, 1, 2)) and grid.models == 12


@pytest.mark.parametrize("kw, kind, message", [
    (dict(models="lr"), TypeError, "models: must be a Grid or a list of Recipes, got 'lr'"),
    (dict(models=[Recipe(), "lr"]), TypeError, "models: must be a Grid or a list of Recipes, got 'lr'"),
    (dict(models=Grid(), base="sgd"), TypeError, "base: must be a Recipe or None, got 'sgd'"),
    (dict(models=Grid(), epochs=0), ValueError, "epochs: must be >= 1, got 0"),
    (dict(models=Grid(), epochs=-1), ValueError, "epochs: must be >= 1, got -1"),
    (dict(models=Grid(), steps=-5), ValueError, "steps: must be >= 1, got -5"),
    (dict(models=Grid(), device=-1), ValueError, "device: must be >= 0, got -1"),
    (dict(models=Grid(), data=42), TypeError, "data: must be a Dataset, a tuple of arrays (x, y), one of mnist, "
                                              "fashion-mnist, kmnist, idx, got 42"),
    (dict(models=Grid(), save_best=-1), ValueError, "save_best: must be an integer >= 0 (the checkpoints kept), "
                                                    "got -1"),
    (dict(models=Grid(), together="yes"), TypeError, "together: must be True or False or None, got 'yes'"),
    (dict(models=Grid(), chunk=0), ValueError, "chunk: must be >= 1 models, got 0"),
])
def test_a_sweep_s_arguments_are_checked_by_the_rules_of_a_run(kw, kind, message):
    """grid.check_sweep: what Sweep(...) checks first (its arguments, before the data is read or a model built)."""
    with pytest.raises(kind) as info:
        check_sweep(**kw)
    assert str(info.value) == message
    check_sweep(Grid(), Recipe(), data="mnist", epochs=2, steps=None, device=1, out="runs", save_best=2,
                together=None, chunk=4)  # good ones pass


def test_a_grid_past_the_bound_is_refused_before_it_is_made():
    from rawgpu.training.grid import MAX_MODELS, Grid, parse_seeds

    with pytest.raises(ValueError, match=r"^'0-100000000' makes more than 100,000 seeds"):
        parse_seeds(["0-100000000"])  # counted, not expanded: at once
    assert len(parse_seeds([f"0-{MAX_MODELS - 1}"])) == MAX_MODELS
    with pytest.raises(ValueError, match=r"^2 lr x 100000 seeds is 200,000 models; a sweep trains at most 100,000$"):
        Grid({"lr": [0.1, 0.2]}, seeds=range(MAX_MODELS))
