"""Every file rawgpu writes goes through `write_atomic`: a crash or Ctrl-C leaves the old file or none, never half."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

_unfinished: set[Path] = set()  # the temps write_atomic is writing now


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write to a temp file beside `path`, flush it to disk, then os.replace it there; on any failure (Ctrl-C
    included) the temp is removed and the exception propagates (OSError for the file system's own).

    The temp is created with the usual permissions (0666 less the umask), so the result looks like a plain write.
    """
    path = Path(path).expanduser()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    _unfinished.add(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _unfinished.discard(tmp)
    return path


def remove_unfinished() -> None:
    """Remove the temps of writes under way, for a process about to exit without unwinding (os._exit: a rank that
    ends its job at once, jobs/job.py): the files they would have replaced stay as they were."""
    for tmp in list(_unfinished):
        tmp.unlink(missing_ok=True)
        _unfinished.discard(tmp)


def cannot_create_in(directory: str | Path) -> str | None:
    """Why write_atomic could not create a file in `directory`, found by creating and removing one (os.access says
    yes to root where the file system still refuses, /proc for one), or None."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".rawgpu-check-"):
            pass
    except OSError as e:
        return f"cannot write in {directory} ({e.strerror or e})"
    return None
