"""Compiling only what a step launches: the units a plan names, the prebuild CLI (python -m rawgpu.compile), and on
the GPU, that a session builds exactly the units its plan names and that a cold start says how long it compiled."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rawgpu.runtime import compiler
from rawgpu import contract
from rawgpu.model.recipe import Recipe
from rawgpu.training.session import kernel_units

gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
DEFAULT = Recipe(hidden=256)
SEED = Recipe(hidden=256, batch=32, lr=0.003, momentum=0.0, schedule="constant")
SMALL = Recipe(hidden=128, batch=32, lr=0.003, momentum=0.0, schedule="constant")  # fits the cluster step


def run(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)


@pytest.mark.parametrize("recipe, kind, expect", [
    (DEFAULT, "fused", {("fused_step.cu", "fused_steps")}),
    (replace(DEFAULT, optimizer="adam", lr=1e-3, momentum=None), "fused", {("fused_step.cu", "fused_steps_adam")}),
    (replace(DEFAULT, optimizer="adamw", lr=1e-3, momentum=None), "layered", {("dx_update.cu", "dx_update_b128_adam"),
                                                               ("head.cu", "head_step_b128_adam")}),
    (SEED, "layered", {("dx_sgd.cu", None), ("head.cu", "head_step_b32_sgd")}),
    (DEFAULT, "layered", {("dx_update.cu", "dx_update_b128_sgd"), ("head.cu", "head_step_b128_sgd")}),
    (SMALL, "cluster", {("cluster_step.cu", "cluster_steps_1")}),
])
def test_a_plan_names_its_units_and_only_its_own(recipe, kind, expect):
    units = kernel_units(recipe, "sm_90", 132, kind)
    assert expect <= set(units)
    assert len(units) == len(set(units)) and set(units) <= set(compiler.all_units())
    assert {("gather.cu", None), ("loss.cu", None), ("elementwise.cu", None)} <= set(units)  # every session's
    if kind != "layered":
        assert all(s not in ("dx_sgd.cu", "dx_update.cu", "head.cu") for s, _ in units)
    gemms = [k for s, k in units if s in ("gemm.cu", "gemm_tma.cu")]
    assert gemms and len(gemms) < 20, "a step names a handful of GEMM instances, not all of them"
    assert not any(s == "gemm.cu" and k is None for s, k in units), "GEMM instances build one at a time"
    adam = recipe.optimizer != "sgd"
    assert not any(k in (("fused_steps", "gemm_staged_cr_sgd_f32") if adam else ("fused_steps_adam",)) for _, k in units)


def test_the_layered_steps_gemms_before_sm90_are_the_units_named():
    units = set(kernel_units(replace(DEFAULT, optimizer="adamw", lr=1e-3, momentum=None), "sm_86", 84, "layered"))
    assert ("gemm.cu", "gemm_staged32_cr_adam_f32") in units and not any(s == "dx_update.cu" for s, _ in units)
    short = set(kernel_units(DEFAULT, "sm_90", 132, "layered"))
    assert not any(k and "_cr_" in k for _, k in short), "the short form launches no dW GEMM"


def test_a_single_kernel_unit_compiles_that_kernel_alone(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("RAWGPU_CACHE", str(tmp_path))
    sources = ("gemm.cu", "gemm_tma.cu", "cluster_step.cu", "fused_step.cu", "dx_update.cu", "head.cu")
    kernels = [contract.split_kernels(source)[-1] for source in sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        modules = list(pool.map(lambda sk: compiler.compile_source(sk[0], "sm_90", kernel=sk[1]), zip(sources, kernels)))
    for source, kernel, module in zip(sources, kernels, modules):
        assert set(module.resources) == {kernel}
        assert compiler.is_cached(source, "sm_90", kernel=kernel) and not compiler.is_cached(source, "sm_90")
        r = module.resources[kernel]
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0 and 0 < r.registers <= 255


def test_prebuild_for_a_recipe_builds_its_units_and_then_finds_them_cached(tmp_path):
    first = run("rawgpu.compile", "--arch", "sm_86", "--hidden", "128", "--batch", "32", "--momentum", "0",
                "--step", "layered", "--cache-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    units = kernel_units(Recipe(hidden=128, batch=32, momentum=0.0), "sm_86", 84, "layered")
    listed = [line.split()[:2] for line in first.stdout.splitlines() if line.startswith("  ")]
    assert sorted(tuple(x) for x in listed) == sorted((s, k or "(whole") for s, k in units)
    assert re.search(rf"built {len(units)} of {len(units)} kernel units for sm_86 in [\d.]+ s", first.stdout)
    again = run("rawgpu.compile", "--arch", "sm_86", "--hidden", "128", "--batch", "32", "--momentum", "0",
                "--step", "layered", "--cache-dir", str(tmp_path))
    assert f"built 0 of {len(units)} kernel units" in again.stdout, again.stdout


def test_prebuild_for_a_tables_recipe_builds_its_regression_head(tmp_path):
    """--inputs, --classes and the task's options plan a table's run: a regression of 8 features on sm_90 builds
    the head kernel's regression instance and the table gather, no pixel gather's build beyond gather.cu's."""
    out = run("rawgpu.compile", "--arch", "sm_90", "--sms", "132", "--inputs", "8", "--classes", "1", "--loss",
              "mse", "--standardize", "--hidden", "256", "--cache-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    recipe = Recipe(hidden=256, inputs=8, classes=1, loss="mse", standardize=True)
    units = kernel_units(recipe, "sm_90", 132, "layered")
    assert ("head.cu", "head_step_b128_sgd_regression") in units
    listed = [line.split()[:2] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert sorted(tuple(x) for x in listed) == sorted((s, k or "(whole") for s, k in units)


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sm_90", "--classes", "1001", "--cache-dir", "{tmp}"], "argument --classes"),
    (["--arch", "sm_90", "--loss", "mse", "--classes", "65", "--cache-dir", "{tmp}"], "argument --classes"),
    (["--arch", "sm_75", "--cache-dir", "{tmp}"], "rawgpu needs sm_80 or newer"),
    (["--arch", "foo", "--cache-dir", "{tmp}"], "bad GPU architecture 'foo'"),
    (["--arch", "sm_86", "--step", "cluster", "--cache-dir", "{tmp}"], "argument --step"),
    (["--arch", "sm_90", "--hidden", "0", "--cache-dir", "{tmp}"], "argument --hidden"),
    (["--arch", "sm_90", "--cache-dir", "{file}"], "is not a directory"),
    (["--arch", "sm_90", "--cache-dir", "{file}/below"], "argument --cache-dir: cannot write the kernel cache"),
])
def test_prebuild_refuses_bad_arguments_in_one_line(tmp_path, argv, message):
    (tmp_path / "file").write_text("")
    argv = [a.format(tmp=tmp_path / "c", file=tmp_path / "file") for a in argv]
    out = run("rawgpu.compile", *argv)
    assert out.returncode == 2 and message in out.stderr.strip().splitlines()[-1], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "c" / "kernels").exists()


def test_an_unwritable_kernel_cache_is_named_as_the_user_set_it():
    out = run("rawgpu.compile", "--arch", "sm_90", env={"RAWGPU_CACHE": "/proc/rawgpu-cache"})
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("python -m rawgpu.compile: error: $RAWGPU_CACHE: cannot write the "
                                                   "kernel cache /proc/rawgpu-cache"), out.stderr


# --- on the GPU ----------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("recipe, kind", [(DEFAULT, "fused"), (DEFAULT, "layered"), (SEED, "layered"),
                                          (SMALL, "cluster")])
def test_a_session_builds_exactly_the_units_its_plan_names(device, rng, recipe, kind):
    """Train, evaluate and predict: every unit the session loaded is one its plan named, and it loaded them all."""
    from test_trainer import synthetic

    from rawgpu.steps import StepOptions, choose
    from rawgpu.training.trainer import Trainer

    if kind == "cluster" and device.arch != "sm_90":
        pytest.skip("the cluster step runs on sm_90")
    data = synthetic(rng, 3000, 700)
    with Trainer(recipe, data=data, steps=30, step=kind) as trainer:
        trainer.fit()
        trainer.evaluate()
        trainer.predict(data.test_images[:300])
        assert set(trainer.session.kernels.modules) == trainer.session.model.kernel_units()  # its one plan's
        options = StepOptions(l2_bytes=device.l2_bytes)  # and the prebuild's list, planned without the GPU
        planned = kernel_units(trainer.recipe, device.arch, device.sm_count, choose(trainer.recipe, device.arch, kind),
                               options)
        assert set(trainer.session.kernels.modules) == set(planned)


@gpu
def test_a_cold_start_compiles_only_its_units_and_says_how_long(device, tmp_path):
    env = {"RAWGPU_CACHE": str(tmp_path)}
    cold = run("rawgpu.train", "--hidden", "256", "--epochs", "1", env=env)
    assert cold.returncode == 0, cold.stderr
    units = kernel_units(Recipe(hidden=256), device.arch, device.sm_count)
    assert re.search(rf"kernels: {len(units)} of {len(units)} kernel units compiled in [\d.]+ s", cold.stdout)
    assert re.search(r"\(wall [\d.]+ s, of which [\d.]+ s compiling\)", cold.stdout), cold.stdout
    assert len(list((tmp_path / "kernels").glob("*.cubin"))) == len(units)
    warm = run("rawgpu.train", "--hidden", "256", "--epochs", "1", env=env)
    assert "kernel cache warm" in warm.stdout and "compiling" not in warm.stdout, warm.stdout
