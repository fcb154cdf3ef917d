"""CPU tests of the training CLI and the model plan: argument checks, messages, exit codes, padding, sizes."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

import numpy as np

from rawgpu.runtime import compiler
from rawgpu import contract
from rawgpu.model import recipe as rc
from rawgpu.cli import train
from rawgpu.data.datasets import Dataset
from rawgpu.runtime.errors import NoDeviceError
from rawgpu.steps import plan_model
from rawgpu.model.recipe import Recipe, pad8

ROOT = Path(__file__).resolve().parent.parent
FAKE_MNIST = Dataset("mnist", *[np.zeros(shape, np.uint8) for shape in ((60000, 784), 60000, (10000, 784), 10000)],
                     (28, 28), 10, Path("."))


@pytest.mark.parametrize("argv,message", [
    (["--hidden", "0"], "argument --hidden: must be >= 1, got 0"),
    (["--hidden", "-5"], "argument --hidden: must be >= 1, got -5"),
    (["--hidden", "wide"], "argument --hidden: expected an integer, got 'wide'"),
    (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["--watchdog", "0"], "argument --watchdog: must be a positive number of seconds, got '0'"),
    (["--save", "/proc/run.safetensors"], "argument --save: cannot write in /proc"),
    (["--hidden", "1000000000"], "argument --hidden: 1000000000 x 3: 2,000,000,797,000,000,010 parameters "
                                 "need at least 20,000,007,970 GB (10 bytes per weight), more than any machine holds"),
    (["--hidden", "200000000", "--layers", "1"], "argument --hidden: 200000000 x 1: 159,000,000,010 "),
    (["--watchdog", "inf"], "argument --watchdog: must be a positive number of seconds, got 'inf'"),
    (["--batch", "60001"], "argument --batch: must be <= 60000, got 60001"),
    (["--lr", "0"], "argument --lr: must be > 0, got 0"),
    (["--lr", "-0.001"], "argument --lr: must be > 0, got -0.001"),
    (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
    (["--lr", "nan"], "argument --lr: must be finite, got 'nan'"),
    (["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
    (["--momentum", "1.5"], "argument --momentum: must be <= 0.999, got 1.5"),
    (["--device", "-1"], "argument --device: must be >= 0, got -1"),
    (["--schedule", "steep"], "argument --schedule: invalid choice: 'steep'"),
    (["--no-graph", "--steps-per-graph", "4"], "--steps-per-graph needs graphs"),
    (["--warmup", "10", "--schedule", "constant"], "argument --warmup: a warm-up ramps up to a decaying schedule"),
    (["--warmup", "500", "--epochs", "1"], "argument --warmup: 500 steps is not shorter than the run (468 steps)"),
    (["--warmup", "100", "--steps", "100"], "argument --warmup: 100 steps is not shorter than the run (100 steps)"),
    (["--data-dir", "/nonexistent/rawgpu-mnist"], "argument --data-dir: no directory /nonexistent/rawgpu-mnist"),
    (["--step", "fused", "--accum", "fp16"], "argument --step: fused cannot run this recipe: the fused step "
                                              "accumulates in fp32 only"),
    (["--step", "fast"], "argument --step/--kernels: invalid choice: 'fast'"),
    (["--kernels", "cluster", "--batch", "64"],
     "argument --step: cluster cannot run this recipe: the cluster step takes batches of at most 32, got 64"),
    (["--step", "cluster", "--batch", "32"], "argument --step: cluster cannot run this recipe: the cluster step "
                                             "runs plain SGD (no momentum, weight decay or Adam), not SGD with "
                                             "momentum 0.9"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--optimizer", "adam", "--momentum", "0.5"], "argument --momentum: applies to --optimizer sgd, not adam"),
    (["--optimizer", "adamw", "--nesterov"], "argument --nesterov: applies to --optimizer sgd, not adamw"),
    (["--betas", "0.9", "0.99"], "argument --betas: applies to --optimizer adam and adamw, not sgd"),
    (["--optimizer", "adam", "--betas", "0.9", "1.5"], "argument --betas: must be <= 0.999999, got 1.5"),
    (["--optimizer", "adam", "--betas", "0.9"], "argument --betas: expected 2 arguments"),
    (["--optimizer", "adam", "--eps", "0"], "argument --eps: must be > 0, got 0"),
    (["--weight-decay", "-1"], "argument --weight-decay: must be >= 0, got -1"),
    (["--nesterov", "--momentum", "0"], "argument --nesterov: needs momentum > 0"),
])
def test_bad_values_exit_2_with_usage_and_one_error_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m rawgpu.train")
    assert message in err.strip().splitlines()[-1]


def test_help_states_the_default_recipe(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "batch 128, SGD with momentum 0.9" in out and "8 epochs" in out and "98%" in out
    for flag in ("--hidden", "--layers", "--batch", "--epochs", "--steps", "--lr", "--momentum", "--schedule",
                 "--optimizer", "--nesterov", "--betas", "--eps", "--weight-decay",
                 "--accum", "--seed", "--data-dir", "--no-graph", "--json", "--device", "--step", "--kernels"):
        assert flag in out


def _no_gpu(monkeypatch):
    def init():
        raise NoDeviceError("no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an NVIDIA GPU")
    monkeypatch.setattr("rawgpu.runtime.driver.init", init)


def test_no_gpu_is_one_line_and_exit_1(monkeypatch, capsys):
    _no_gpu(monkeypatch)
    monkeypatch.setattr("rawgpu.data.datasets.load_dataset", lambda *a, **k: FAKE_MNIST)  # the data loads first
    assert train.main(["--hidden", "256"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "rawgpu: error: no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an NVIDIA GPU"]
    assert captured.out == ""


def test_inspect_graph_without_gpu_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    _no_gpu(monkeypatch)
    spec = importlib.util.spec_from_file_location("inspect_graph", ROOT / "scripts" / "inspect_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path / "step.dot")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["inspect_graph: error: no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an "
                   "NVIDIA GPU"]
    assert not (tmp_path / "step.dot").exists()


def test_inspect_graph_unwritable_out_is_one_line_and_exit_1(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("inspect_graph", ROOT / "scripts" / "inspect_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert module.main(["--out", str(blocker / "step.dot")]) == 1  # a file where a directory must be
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("inspect_graph: error: cannot write") and str(blocker) in err[0]


def test_bench_bad_out_directory_is_one_line(monkeypatch, capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blocker = tmp_path / "file"
    blocker.write_text("")

    def fail(args):
        Path(args.out).mkdir(parents=True, exist_ok=True)  # what cmd_train does first with --out
    monkeypatch.setattr(module, "cmd_train", fail)
    assert module.main(["--out", str(blocker / "results")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench: error:") and str(blocker) in err[0]


@pytest.mark.parametrize("argv, steps, recipe", [
    ([], 5000, dict(batch=32, optimizer="sgd", lr=0.003, momentum=0.0, schedule="constant")),
    (["--recipe", "default"], 8 * 468, dict(batch=128, optimizer="sgd", lr=0.05, momentum=0.9, schedule="cosine")),
    (["--recipe", "default", "--batch", "256"], 8 * 234, dict(batch=256, lr=0.05, momentum=0.9, schedule="cosine")),
    (["--recipe", "default", "--steps", "100"], 100, dict(batch=128, lr=0.05, momentum=0.9, schedule="cosine")),
    (["--recipe", "adam"], 8 * 468, dict(batch=128, optimizer="adam", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                         schedule="cosine")),
    (["--recipe", "default", "--optimizer", "adamw"], 8 * 468, dict(batch=128, optimizer="adamw", lr=1e-3,
                                                                    weight_decay=0.01, schedule="cosine")),
    (["--recipe", "adam", "--optimizer", "sgd", "--batch", "64"], 8 * 937, dict(batch=64, optimizer="sgd", lr=0.05,
                                                                                momentum=0.9)),
])
def test_bench_recipes_are_the_clis(monkeypatch, argv, steps, recipe):
    """bench.py train --recipe: seed is the reference workload, default is the CLI's default recipe, adam its Adam
    twin, with its epochs' steps unless --steps says otherwise; --optimizer swaps in another optimiser with the
    CLI's defaults for it."""
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}
    monkeypatch.setattr(module, "cmd_train", lambda args: seen.update(steps=args.steps, recipe=args.train_recipe))
    module.main(["train", *argv])
    assert seen["steps"] == steps and {k: seen["recipe"][k] for k in recipe} == recipe
    from benchmarks.training import OPTIMIZER_KEYS

    default, cli = module.RECIPES["default"], Recipe()
    assert default["epochs"] == rc.DEFAULTS["epochs"]
    assert {k: default[k] for k in OPTIMIZER_KEYS + ("batch", "schedule")} == \
        {k: getattr(cli, k) for k in OPTIMIZER_KEYS + ("batch", "schedule")}


def test_plan_epochs_and_steps():
    args = train.build_parser().parse_args(["--batch", "128", "--epochs", "3"])
    plan = train.make_plan(args)
    assert (plan.epochs, plan.total_steps, plan.steps_per_epoch) == (3, 3 * 468, 468)
    args = train.build_parser().parse_args(["--batch", "32", "--steps", "5000"])
    plan = train.make_plan(args)
    assert (plan.epochs, plan.total_steps) == (3, 5000)
    assert [plan.steps_in(e) for e in range(3)] == [1875, 1875, 1250]
    recipe = train.make_recipe(args, plan)
    assert recipe.total_steps == 5000 and recipe.batch == 32 and recipe.momentum == 0.9


def test_model_plan_pads_widths_and_sizes_the_arena():
    recipe = Recipe(hidden=100, layers=2, batch=50, momentum=0.9)
    model = plan_model(recipe, sm_count=132)
    assert recipe.widths == [784, 100, 100, 10] and model.padded == [784, 104, 104, 16]
    assert recipe.parameters == 784 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10
    assert [lay.wlo.shape for lay in model.layers] == [(784, 104), (104, 104), (104, 16)]
    assert model.kind == "fused"
    layered = plan_model(recipe, "layered", sm_count=132).step
    assert layered.plans[0].dx is None and all(p.dx is not None for p in layered.plans[1:])
    assert all(lay.mw is not None for lay in model.layers)
    assert model.eval_batch == 10000
    dataset = 60000 * 784 + 60000 + 10000 * 784 + 10000
    assert dataset < model.arena.peak_bytes < dataset + 64 * 2**20
    weights = 784 * 256 + 256 * 256 * 2 + 2560
    assert Recipe(momentum=0.0)._step_bytes() == 10 * weights  # the split master (rawgpu/model/master.py)
    assert Recipe(momentum=0.0)._step_bytes(12) == 12 * weights and Recipe(momentum=0.9)._step_bytes() == 18 * weights
    assert plan_model(Recipe(momentum=0.0), sm_count=132).layers[0].mw is None


def test_big_models_evaluate_in_chunks_and_plans_refuse_bad_recipes():
    assert plan_model(Recipe(hidden=16384, layers=1), sm_count=132).eval_batch == 5000
    assert pad8(1) == 8 and pad8(16) == 16
    with pytest.raises(ValueError, match="batch"):
        Recipe(batch=0)
    with pytest.raises(ValueError, match="schedule"):
        Recipe(schedule="steep")


@pytest.mark.parametrize("script,argv", [("profile_gemm", ["--hidden", "256"]),
                                         ("forward_tiles", ["--shapes", "4096x1024x64", "--cublas"])])
def test_gemm_dev_scripts_without_gpu_are_one_line_and_exit_1(monkeypatch, capsys, script, argv):
    _no_gpu(monkeypatch)
    spec = importlib.util.spec_from_file_location(script, ROOT / "dev" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{script}: error: no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an NVIDIA GPU"]


def test_gemm_variants_tensor_copy_tiles_need_sm90():
    from benchmarks.gemm import variants_error  # dev/gemm_variants.py's check, through open_gpu

    why = variants_error(["stream", "tma", "tma128"], "sm_86")
    assert why is not None and "tma tma128" in why and "sm_90" in why and "sm_86" in why and "\n" not in why
    assert variants_error(["stream", "tma"], "sm_90") is None
    assert variants_error(["stream"], "sm_86") is None


def test_a_data_dir_without_the_files_is_a_usage_error_before_any_gpu_work(capsys, tmp_path, monkeypatch):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")  # one of the four: present (not checked for content)
    monkeypatch.setattr(train, "train", lambda *a: pytest.fail("training started"))
    with pytest.raises(SystemExit) as info:
        train.main(["--data-dir", str(tmp_path)])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"python -m rawgpu.train: error: argument --data-dir: {tmp_path} lacks train-labels-idx1-ubyte, "
                    "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (raw or .gz)")


def test_the_summary_counts_an_epoch_that_finished_at_zero_accuracy():
    from rawgpu.cli.console import Summary, format_summary

    s = Summary(train_seconds=1.0, wall_seconds=2.0, steps=936, best_accuracy=0.0, best_epoch=1, time_to_98=None,
                interrupted=False)
    assert "best test accuracy 0.00% (epoch 1)" in format_summary(s)


def test_main_hands_training_the_data_and_recipe_it_checked(monkeypatch):
    from rawgpu.runtime import driver

    seen = {}
    monkeypatch.setattr(driver, "init", lambda: None)
    monkeypatch.setattr(driver, "device_count", lambda: 1)
    monkeypatch.setattr("rawgpu.data.datasets.load_dataset", lambda *a, **k: FAKE_MNIST)
    monkeypatch.setattr(train, "train", lambda args, data, recipe, console, t, ckpt, final=None: seen.update(
        data=data, recipe=recipe, ckpt=ckpt) or 0)
    assert train.main(["--batch", "32", "--steps", "5000", "--hidden", "100", "--json"]) == 0
    assert seen["data"] is FAKE_MNIST and seen["ckpt"] is None
    assert seen["recipe"] == Recipe(hidden=100, batch=32, total_steps=5000)


def test_persistent_phase_experiment_builds_for_sm_90():
    """dev/persistent/phase_chain.cu (the experiment of `python dev/persistent/run.py`) still compiles: an experiment
    that rots cannot be rerun to check its numbers."""
    spec = importlib.util.spec_from_file_location("persistent_run", ROOT / "dev" / "persistent" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cubin, log = module.build("sm_90")
    assert cubin[:4] == b"\x7fELF"
    report = compiler.parse_ptxas_report(log)
    assert sorted(report) == ["phase_chain_n1", "phase_chain_n2", "phase_chain_n4"]
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in report.values())


@pytest.mark.parametrize("source, kernel", [("gemm.cu", "gemm_stream_rr_bias_act_f32"),
                                            ("gemm.cu", "gemm_128x128_rc_dact_f32"),
                                            ("gemm.cu", "gemm_staged_cr_sgd_f32"),
                                            ("dx_update.cu", "dx_update_b128_sgd")])
def test_the_model_axis_experiments_build_for_sm_90(source, kernel, tmp_path, monkeypatch):
    """gemm.cu and dx_update.cu with the model axis (-DGEMM_MODELS=1 as dev/sweep/gemm_models.py builds it,
    -DDXU_MODELS=1 as dx_update_models.cu does) still compile the tiles launched over models, without spills."""
    monkeypatch.setenv("RAWGPU_CACHE", str(tmp_path))
    define = {"gemm.cu": "-DGEMM_MODELS=1", "dx_update.cu": "-DDXU_MODELS=1"}[source]
    built = compiler.compile_source(source, "sm_90", (define,), kernel=kernel)
    assert list(built.resources) == [kernel] and built.resources[kernel].spill_stores == 0


def test_the_save_note_says_what_the_checkpoint_file_holds(tmp_path):
    from types import SimpleNamespace

    from rawgpu.cli import train_run

    def trainer(saved, done, given_up=False, ranks=1):
        session = SimpleNamespace(gpu_given_up=lambda: given_up)
        return SimpleNamespace(saved=saved, steps_done=done, session=session,
                               rank=SimpleNamespace(ranks=ranks) if ranks > 1 else None)

    path = str(tmp_path / "run.safetensors")
    assert train_run.save_note(trainer((path, 40), 40), path) == f"checkpoint: {path} (step 40)"
    assert train_run.save_note(trainer(None, 40, given_up=True), path) == (
        "the GPU had not reached a step boundary after the interrupt: nothing saved when it stopped; "
        "no checkpoint was written")
    assert train_run.save_note(trainer((path, 30), 40, given_up=True), path).endswith(f"; {path} keeps step 30")
    (tmp_path / "run.safetensors").write_bytes(b"x")
    assert train_run.save_note(trainer(None, 40, ranks=2), path) == (
        f"interrupted on several GPUs: nothing saved when it stopped; {path} keeps the checkpoint it had")


@pytest.mark.parametrize("field,value,message", [
    ("hidden", 1.5, "hidden: must be an integer >= 1, got 1.5"),
    ("hidden", True, "hidden: must be an integer >= 1, got True"),
    ("hidden", "wide", "hidden: must be an integer >= 1, got 'wide'"),
    ("layers", 2.0, "layers: must be an integer in 1..64, got 2.0"),
    ("lr", "fast", "lr: must be a number > 0, got 'fast'"),
    ("nesterov", 1, "nesterov: must be True or False, got 1"),
    ("optimizer", 3, "optimizer: must be one of sgd, adam, adamw, got 3"),
    ("hidden", 10**9, "hidden: 1000000000 x 3: 2,000,000,797,000,000,010 parameters need at least"),
])
def test_a_recipe_names_a_field_of_the_wrong_kind_and_what_it_takes(field, value, message):
    with pytest.raises(ValueError) as info:
        Recipe(**{field: value})
    assert str(info.value).startswith(message)
    assert isinstance(info.value, TypeError) == (value != 10**9)  # the wrong kind is a TypeError too
    assert Recipe(hidden=np.int64(128), lr=np.float32(0.1)).hidden == 128  # numpy's numbers are numbers


def test_the_package_lists_its_api_and_errors():
    import rawgpu

    names = dir(rawgpu)
    for name in ("Trainer", "Recipe", "Evaluation", "TrainingDiverged", "RawgpuError", "CheckpointError",
                 "GpuHangError", "NoDeviceError", "OutOfMemoryError", "DataError", "StepUnsupported", "Dataset",
                 "load_dataset", "EpochStats", "Terminated", "SettingError", "Sweep", "Grid"):
        assert name in names and name in rawgpu.__all__
        assert getattr(rawgpu, name).__name__ == name
    assert not [name for name in names if name.startswith("_") and name != "__version__"]
    assert issubclass(rawgpu.CheckpointError, rawgpu.RawgpuError) and rawgpu.GpuHangError.__module__ == "rawgpu.runtime.errors"


@pytest.mark.parametrize("make, argv, name, reason", [
    (lambda T: T(epochs=0), ["--epochs", "0"], "epochs", "must be >= 1, got 0"),
    (lambda T: T(steps=0), ["--steps", "0"], "steps", "must be >= 1, got 0"),
    (lambda T: T(device=-1), ["--device", "-1"], "device", "must be >= 0, got -1"),
    (lambda T: T(Recipe(warmup_steps=500), epochs=1), ["--warmup", "500", "--epochs", "1"], "warmup_steps",
     "500 steps is not shorter than the run (468 steps)"),
    (lambda T: T(Recipe(hidden=10**9)), ["--hidden", "1000000000"], "hidden",
     "1000000000 x 3: 2,000,000,797,000,000,010 parameters need at least"),
])
def test_the_api_and_the_cli_refuse_a_run_by_the_same_rule(monkeypatch, capsys, make, argv, name, reason):
    """One owner (recipe.py) checks a run: the API names the parameter, the CLI the flag, with the same reason."""
    from rawgpu import Trainer

    monkeypatch.setattr("rawgpu.training.trainer.load_dataset", lambda *a, **k: FAKE_MNIST)
    monkeypatch.setattr("rawgpu.training.session.Session", lambda *a, **k: pytest.fail("the GPU was opened"))
    with pytest.raises(ValueError) as info:
        make(Trainer)
    assert str(info.value).startswith(f"{name}: {reason}")
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    flag = {"warmup_steps": "warmup"}.get(name, name)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"python -m rawgpu.train: error: argument --{flag}: {reason}")


@pytest.mark.parametrize("tool", ["train", "evaluate", "predict", "compile"])
def test_every_cli_says_its_version(capsys, tool):
    import importlib

    import rawgpu

    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"rawgpu.{tool}").main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"rawgpu {rawgpu.__version__}\n"


def test_python_m_rawgpu_lists_the_commands(capsys):
    import subprocess

    import rawgpu
    from rawgpu.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m rawgpu.COMMAND [options]" in out
    for command in ("train", "evaluate", "predict", "compile", "sweep", "launch"):
        assert f"\n  {command} " in out
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"rawgpu {rawgpu.__version__}\n"
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rawgpu: error: unknown argument 'train'; run python -m rawgpu.train")
    p = subprocess.run([sys.executable, "-m", "rawgpu"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and "python -m rawgpu.COMMAND --help" in p.stdout and p.stderr == ""


def test_several_gpus_without_nccl_is_one_line_and_exit_1(monkeypatch, capsys):
    """Missing NCCL is the installation's failing, not an argument's: exit 1, not 2 (as a launcher's rank)."""
    from rawgpu.runtime import install
    from rawgpu.runtime import nccl

    monkeypatch.setattr(install, "nccl_stack_problem", lambda: None)
    monkeypatch.setattr(nccl, "available", lambda: "several GPUs need NCCL, which is not installed: pip install x")
    with pytest.raises(SystemExit) as info:
        train.main(["--gpus", "2"])
    assert info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "rawgpu: error: --gpus 2: several GPUs need NCCL, which is not installed: pip install x"]


def test_nccl_of_the_other_cuda_stack_is_refused_before_it_is_loaded_with_the_command(monkeypatch, capsys):
    from rawgpu.runtime import driver, install
    from rawgpu.runtime import nccl

    monkeypatch.setattr(install, "origin", lambda: "/src/rawgpu")
    monkeypatch.setattr(driver, "bindings_major", lambda: 12)
    monkeypatch.setattr(install, "nccl_packages", lambda: ("cu13",))  # pip install ".[cu12,multi]" did this
    why = ("NCCL is installed for the other CUDA stack (nvidia-nccl-cu13 beside the cu12 bindings); several GPUs "
           'need the cu12 one: pip uninstall -y nvidia-nccl-cu13 && pip install "/src/rawgpu[cu12,multi-cu12]"')
    assert install.nccl_stack_problem() == why
    monkeypatch.setattr(nccl, "available", lambda: pytest.fail("NCCL was loaded"))
    with pytest.raises(SystemExit) as info:
        train.main(["--gpus", "2"])
    assert info.value.code == 1 and capsys.readouterr().err.strip().splitlines() == [f"rawgpu: error: --gpus 2: {why}"]
    monkeypatch.setattr(install, "nccl_packages", lambda: ("cu12",))
    assert install.nccl_stack_problem() is None
    monkeypatch.setattr(driver, "bindings_major", lambda: 13)
    monkeypatch.setattr(install, "nccl_packages", lambda: ("cu12", "cu13"))  # both: the cu12 one must go
    assert install.nccl_stack_problem().startswith("NCCL is installed for the other CUDA stack (nvidia-nccl-cu12 ")

    def no_bindings():
        raise ImportError("No module named 'cuda'")
    monkeypatch.setattr(driver, "bindings_major", no_bindings)
    assert install.nccl_stack_problem() is None


def test_each_nccl_extra_pins_its_stack_so_the_wrong_pair_cannot_install():
    """".[cu12,multi]" would install NCCL for CUDA 13 beside the CUDA 12 bindings: each NCCL extra pins its stack's
    cuda-bindings, so pip refuses the pair (scripts/check_extras.py checks it against the index). And the license is
    the SPDX string current setuptools wants."""
    import re

    from rawgpu.runtime import install

    text = (ROOT / "pyproject.toml").read_text()
    lines = {line.split("=")[0].strip(): line for line in text.splitlines() if "=" in line}
    pin = lambda line: re.search(r'"cuda-bindings([^"]*)"', line).group(1)  # noqa: E731
    for stack, multi in install.MULTI.items():
        assert pin(lines[multi]) == pin(lines[stack]), multi
    assert pin(lines["multi"]) != pin(lines["multi-cu12"])
    assert 'license = "MIT"' in text and '"setuptools>=77"' in text


def test_gpu_check_says_its_usage_and_needs_a_gpu_from_any_directory(tmp_path):
    import subprocess

    script = ROOT / "scripts" / "gpu_check.sh"
    help_ = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: bash scripts/gpu_check.sh") and not help_.stderr
    from conftest import _gpu_status

    if _gpu_status()[0] is not None:
        return  # with a GPU it runs everything: the GPU session's own call
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and p.stdout == "" and len(lines) == 1 and lines[0].startswith("gpu_check: error: ")
    assert not (tmp_path / "out" / "pytest.log").exists()  # nothing ran


def test_install_hints_are_commands_that_work_for_this_installation(monkeypatch):
    """rawgpu is installed from its checkout: a hint names the checkout (or "." there) and keeps the CUDA stack, and
    several GPUs take the NCCL built for that stack."""
    from rawgpu.runtime import install

    monkeypatch.setattr(install, "origin", lambda: ".")
    monkeypatch.setattr(install, "stack", lambda: "cu13")
    assert install.hint("plot") == 'pip install ".[cu13,plot]" in the rawgpu checkout'
    assert install.hint("multi") == 'pip install ".[cu13,multi]" in the rawgpu checkout'
    monkeypatch.setattr(install, "origin", lambda: "/src/rawgpu")
    monkeypatch.setattr(install, "stack", lambda: "cu12")
    assert install.hint("multi") == 'pip install "/src/rawgpu[cu12,multi-cu12]"'
    lines = {line.split("=")[0].strip(): line for line in (ROOT / "pyproject.toml").read_text().splitlines()
             if "=" in line}  # Python 3.10 has no tomllib: the extras are one line each
    for stack, multi in install.MULTI.items():
        assert stack in lines and f'"nvidia-nccl-{stack}' in lines[multi], multi


def test_the_extras_check_flags_a_resolution_that_mixes_cuda_stacks():
    """scripts/check_extras.py (run by CI against the index): a package of the other stack, or bindings of the
    other major version, is flagged; a resolution of one stack is not."""
    spec = importlib.util.spec_from_file_location("check_extras", ROOT / "scripts" / "check_extras.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    package = lambda name, version: {"metadata": {"name": name, "version": version}}  # noqa: E731
    clean = {"install": [package("cuda-bindings", "12.9.4"), package("nvidia-nccl-cu12", "2.28.9"),
                         package("numpy", "2.3.0")]}
    assert module.mixing(clean, "cu12") == []
    mixed = {"install": [package("cuda-bindings", "12.9.4"), package("nvidia-nccl-cu13", "2.28.9")]}
    assert module.mixing(mixed, "cu12") == ["nvidia-nccl-cu13 2.28.9"]
    assert module.mixing(clean, "cu13") == ["cuda-bindings 12.9.4", "nvidia-nccl-cu12 2.28.9"]


def test_a_console_script_names_itself_in_its_usage(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/rawgpu-train"])
    assert train.build_parser().prog == "rawgpu-train"
    monkeypatch.setattr(sys, "argv", ["/x/rawgpu/train.py"])  # python -m rawgpu.train
    assert train.build_parser().prog == "python -m rawgpu.train"


def test_bench_without_a_gpu_leaves_no_empty_results_folder(monkeypatch, capsys, tmp_path):
    _no_gpu(monkeypatch)
    monkeypatch.setattr("rawgpu.runtime.driver.Device", lambda *a: (_ for _ in ()).throw(NoDeviceError("no CUDA GPU found")))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "results"
    assert module.main(["train", "--out", str(out), "--peers"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == ["bench: error: no CUDA GPU found"]
    assert not out.exists()
