"""Checks the GPU tests share: a launch run twice from the same state (bitwise repeatability), an SGD step on the
split master weights against float64, and a training CLI interrupted by Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rawgpu.model import master


def run_twice(launch, stream, state: list, poisoned: list, outputs: list) -> list[list[np.ndarray]]:
    """Before each run: upload every (tensor, array) of `state` (inputs the kernel updates in place) and fill every
    tensor of `poisoned` with 0xFF bytes (NaN in fp16/fp32); after it, download `outputs`. Two lists of arrays."""
    runs = []
    for _ in range(2):
        for t, a in state:
            t.upload(a)
        for t in poisoned:
            t.fill_bytes(0xFF)
        launch.run(stream)
        runs.append([t.download() for t in outputs])
    return runs


def assert_same_bytes(runs: list[list[np.ndarray]]) -> None:
    """Bytes, not values: an unwritten (poisoned, NaN) output compares too."""
    for a, b in zip(runs[0], runs[1]):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "results differ between identical runs"


def check_master_step(w: np.ndarray, w16: np.ndarray, wlo: np.ndarray, lr: float, step_ref: np.ndarray) -> None:
    """The master after w -= lr G (two halves, rawgpu/model/master.py) against G = step_ref in float64: rel err <= 2e-3,
    every weight whose step is not tiny moved (the master is updated in place, so it cannot be poisoned), and W16
    is fp16(master) exactly."""
    w_new = master.join(w16, wlo)
    step = (w.astype(np.float64) - w_new) / float(lr)
    err = np.linalg.norm(step - step_ref) / np.linalg.norm(step_ref)
    assert err <= 2e-3, f"update rel err {err:.2e}"
    big = np.abs(step_ref) > 1e-3 * np.abs(step_ref).max()
    assert (w_new[big] != w[big]).all(), "weights left unwritten"
    assert np.array_equal(w16.view(np.uint16), w_new.astype(np.float16).view(np.uint16)), \
        "W16 must be fp16(master) exactly"


def interrupt_train(args: list[str], when: str, root: Path, sig: int = signal.SIGINT,
                    command: list[str] | None = None) -> tuple[int, str, str, float]:
    """Run `python -m rawgpu.train args` (or `command` + args), send `sig` once a stdout line starts with `when`
    (training is under way), and return (exit status, stdout after that line, stderr, seconds from the signal to
    the exit). The child starts with the default SIGINT handler whatever this process ignores, and is killed if it
    outlives a minute."""
    command = command or [sys.executable, "-m", "rawgpu.train"]
    proc = subprocess.Popen([*command, *args], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline and not line.startswith(when):
            line = proc.stdout.readline().strip()
            assert line or proc.poll() is None, proc.stderr.read()
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        seconds = time.monotonic() - sent
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    return proc.returncode, out, err, seconds


class LateDxKernels:
    """Kernels whose builds start every dx block of the one-pass backward late (a busy wait after apart_begin, put
    into the source's text here: the product kernels carry no such path), as a block switched out with its context,
    or held up behind another kernel's blocks, would start: with dx and the update apart, the update blocks must
    still wait for their partner before overwriting the weights it reads."""

    LATE_NS = 200_000
    BEGIN = "    apart_begin(&apart_held);\n"
    LATE = ("    if (gridDim.y == 2 && blockIdx.y == 0) {  // the dx block starts LATE_NS late\n"
            "        u64 start, now;\n"
            "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(start));\n"
            "        do {\n"
            "            asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(now));\n"
            "        } while (now - start < (u64){ns});\n"
            "    }\n")

    def __init__(self, arch: str):
        self.arch, self.activation, self._modules = arch, "relu", []

    def get(self, source: str, name: str):
        from rawgpu.runtime import compiler, driver

        unit = compiler.unit_of(source, name)  # one instance of a many-instance source, or the whole small source
        text = (compiler.SOURCE_DIR / unit[0]).read_text()
        assert text.count(self.BEGIN) == 1, f"{unit[0]}: apart_begin moved; this check needs updating"
        text = text.replace(self.BEGIN, self.BEGIN + self.LATE.replace("{ns}", str(self.LATE_NS)))
        built = compiler.compile_variant(unit[0], text, self.arch, kernel=unit[1])
        self._modules.append(driver.Module.of(built))
        return self._modules[-1].kernel(name)
