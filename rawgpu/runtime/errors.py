"""Every error rawgpu raises on purpose derives from RawgpuError, so the CLI can print one line and exit."""

import signal
import sys
import threading
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


class GpuHangError(RawgpuError):
    """Work queued on the GPU did not finish within the watchdog's limit (driver.wait_until)."""


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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: the process stops the same way (a run at a step
    boundary, saving what Ctrl-C saves) instead of dying mid-step, and exits 143."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def stop_on_sigterm() -> None:
    """Make SIGTERM stop this process as Ctrl-C does (Terminated). Only the main thread may set handlers."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def interrupt_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by a signal: 128 + its number, as shells report it."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def run_cli(work: Callable[[], int], prog: str = "rawgpu") -> int:
    """A CLI's work after its arguments are parsed (the product's and the dev scripts', `prog` naming it): a
    RawgpuError becomes one line on stderr and exit 1, Ctrl-C exit 130, SIGTERM exit 143."""
    stop_on_sigterm()
    try:
        return work()
    except RawgpuError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"{prog}: interrupted" if not isinstance(exc, Terminated) else f"{prog}: terminated", file=sys.stderr)
        return interrupt_status(exc)
