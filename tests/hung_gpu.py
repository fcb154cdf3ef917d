"""`python -m rawgpu.train ARGS` whose GPU never finishes: before training starts, a kernel that keeps the GPU busy
for 10 s is queued on the training stream, so every step waits behind it. Prints `hung_gpu: spinning` once it
is queued. The GPU tests run this to see a run give such a GPU up (--watchdog) and stop on a signal at once."""

from __future__ import annotations

import sys
from pathlib import Path

from rawgpu.runtime import compiler, driver
from rawgpu.cli import train
from rawgpu.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
SPIN_NS = 10 * 10**9


def main(argv: list[str]) -> int:
    fit = Trainer.fit

    def fit_behind_a_spinning_kernel(self, *args, **kwargs):
        cubin = compiler.compile_file(ROOT / "tests" / "kernels" / "spin.cu", self.session.device.arch).cubin
        self._spin_module = driver.Module(cubin)  # kept: a module unloaded under a running kernel would wait for it
        driver.launch(self._spin_module.kernel("spin", "q"), 1, 1, 0, self.stream, SPIN_NS)
        print("hung_gpu: spinning", flush=True)
        return fit(self, *args, **kwargs)

    Trainer.fit = fit_behind_a_spinning_kernel
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
