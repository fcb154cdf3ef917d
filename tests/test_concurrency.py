"""Several rawgpu processes on one GPU at once, and runs whose GPU never finishes. Every child runs in a process
group of its own under a hard time limit, so a failing test ends its children instead of leaving them on the GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_checks import interrupt_train

gpu = pytest.mark.gpu
exclusive = pytest.mark.gpu_exclusive  # many processes, or a GPU kept busy on purpose: never beside other GPU tests
ROOT = Path(__file__).resolve().parent.parent
SEED_RECIPE = ["--batch", "32", "--momentum", "0", "--lr", "0.003", "--schedule", "constant"]
KINDS = {  # what `auto` runs at batch 128 (layered, SGD and Adam), and the two kinds named
    "layered": ["--hidden", "256"],
    "layered-adam": ["--hidden", "256", "--optimizer", "adam"],
    "fused": ["--hidden", "256", "--step", "fused"],
    "cluster": ["--hidden", "128", *SEED_RECIPE, "--step", "cluster"],
}
PROCESSES = 8
LIMIT = 240.0  # seconds for all of them together; they take a few


def start_train(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rawgpu.train", *args], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def finish_all(procs: list[subprocess.Popen], limit: float) -> list[tuple[int, str, str]]:
    """Each child's (exit status, stdout, stderr); a child still running after `limit` seconds fails the test,
    after its whole process group has been killed."""
    deadline = time.monotonic() + limit
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{sum(p.poll() is None for p in procs)} of {len(procs)} training processes still ran after "
                    f"{limit:.0f} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return results


def last_epoch(stdout: str) -> tuple[float, float]:
    """The last epoch's train loss and test accuracy (--json)."""
    last = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")][-1]
    return last["train_loss"], last["test_accuracy"]


@gpu
@exclusive
@pytest.mark.parametrize("kind", KINDS)
def test_eight_processes_of_a_step_kind_share_one_gpu_and_train_as_one_alone(kind, device):
    if kind == "cluster" and device.compute_capability < (9, 0):
        pytest.skip(f"the cluster step needs sm_90; this GPU is {device.arch}")
    args = [*KINDS[kind], "--steps", "300", "--seed", "3", "--json"]
    [(status, out, err)] = finish_all([start_train(args)], LIMIT)  # alone first: it also fills the kernel cache
    assert status == 0, err
    alone = last_epoch(out)
    results = finish_all([start_train(args) for _ in range(PROCESSES)], LIMIT)
    for status, out, err in results:
        assert status == 0, err
        assert last_epoch(out) == alone  # the same seed: the same arithmetic, whatever else runs on the GPU


def hung_run(args: list[str]) -> subprocess.Popen:
    """tests/hung_gpu.py: the training CLI behind a kernel that keeps the GPU busy for a minute."""
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "hung_gpu.py"), *args], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


@gpu
@exclusive
def test_the_watchdog_gives_a_gpu_that_never_finishes_up_in_one_line(device, tmp_path):
    save = tmp_path / "run.safetensors"
    proc = hung_run(["--hidden", "64", "--steps", "500", "--watchdog", "2", "--save", str(save)])
    try:
        line, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline and line != "hung_gpu: spinning":
            line = proc.stdout.readline().strip()
            assert line or proc.poll() is None, proc.stderr.read()
        queued = time.monotonic()
        proc.wait(timeout=30)
        seconds = time.monotonic() - queued
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("rawgpu: error: the GPU has not finished the work queued before step 1 in 2 s"), err
    assert "Traceback" not in err
    assert seconds < 2.0 + 3.0, f"the run took {seconds:.2f} s to give the GPU up and end"
    assert not save.exists()  # nothing was saved, half-written or not


@gpu
@exclusive
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl_c", "sigterm"])
def test_a_signal_ends_a_run_whose_gpu_never_finishes_within_2_s(sig, status, device, tmp_path):
    save = tmp_path / "run.safetensors"
    got, out, err, seconds = interrupt_train(["--hidden", "64", "--steps", "500", "--save", str(save)],
                                             "hung_gpu: spinning", ROOT, sig,
                                             command=[sys.executable, str(ROOT / "tests" / "hung_gpu.py")])
    assert got == status, err
    assert seconds < 2.0, f"the run took {seconds:.2f} s to stop"
    assert "Traceback" not in err
    assert "nothing saved when it stopped; no checkpoint was written" in out
    assert not save.exists()


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_the_experiment_and_the_stand_in_for_a_hung_gpu_build(arch):
    """dev/concurrency/pdl_chain.cu (docs/design.md's experiment) and tests/kernels/spin.cu still compile."""
    from rawgpu.runtime import compiler

    for path, kernels in ((ROOT / "dev" / "concurrency" / "pdl_chain.cu", ["pdl_handoff", "pdl_link"]),
                          (ROOT / "tests" / "kernels" / "spin.cu", ["spin"])):
        report = compiler.parse_ptxas_report(compiler.compile_file(path, arch).log)
        assert sorted(report) == kernels and all(r.spill_stores == 0 for r in report.values()), path.name


def test_the_launch_chain_experiment_refuses_a_missing_gpu_in_one_line(monkeypatch, capsys):
    import importlib.util

    from rawgpu.runtime.errors import NoDeviceError

    def no_gpu(*args):
        raise NoDeviceError("no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an NVIDIA GPU")

    spec = importlib.util.spec_from_file_location("pdl_chain", ROOT / "dev" / "concurrency" / "pdl_chain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.driver, "Device", no_gpu)
    assert module.main(["--variant", "plain"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "pdl_chain: error: no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an NVIDIA GPU"]
