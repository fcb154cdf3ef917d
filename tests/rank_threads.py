"""Ranks of a job as threads of one test process: each runs fn(rank); what any raised comes back, and none may still
be running after `timeout` seconds."""

from __future__ import annotations

import threading
from typing import Callable


def run_ranks(fn: Callable[[int], None], size: int, timeout: float = 30.0) -> list[BaseException]:
    """fn(0) .. fn(size - 1) at once, each on its own thread; the exceptions they raised (an assertion fails if one is
    still running after `timeout`)."""
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a rank still runs after {timeout} s"
    return errors
