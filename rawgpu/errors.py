"""Every error rawgpu raises on purpose derives from RawgpuError, so the CLI can print one line and exit."""

import sys
from typing import Callable


class RawgpuError(Exception):
    """A failure with a message meant for the user: one sentence, no traceback needed."""


class NoDeviceError(RawgpuError):
    """No usable NVIDIA GPU or driver."""


class CudaError(RawgpuError):
    """A CUDA driver call failed; names the call, the error name and the driver's description."""

    def __init__(self, call: str, name: str, description: str = ""):
        self.call, self.name, self.description = call, name, description
        super().__init__(f"{call} failed: {name}" + (f" ({description})" if description else ""))


class CompileError(RawgpuError):
    """NVRTC rejected a source; the message carries the compiler log."""


class OutOfMemoryError(RawgpuError):
    """The device has less free memory than a plan needs."""


class GraphCaptureError(RawgpuError):
    """Stream capture into a CUDA graph failed."""


class DataError(RawgpuError):
    """A dataset file is missing, truncated, corrupt or of the wrong kind."""


class StepUnsupported(RawgpuError, ValueError):
    """A step kind asked for by name cannot run this recipe on this GPU; the message says why."""


def run_cli(work: Callable[[], int]) -> int:
    """A CLI's work after its arguments are parsed: a RawgpuError becomes one line on stderr and exit 1, Ctrl-C
    exit 130."""
    try:
        return work()
    except RawgpuError as exc:
        print(f"rawgpu: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rawgpu: interrupted", file=sys.stderr)
        return 130
