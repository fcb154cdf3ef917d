"""Every kernel source built whole for every arch the CPU tests check, on as many threads as there are CPUs, the
largest first (NVRTC releases the GIL), into $RAWGPU_CACHE.

conftest.py starts this as a process of its own when the session begins, so the builds overlap the tests that run
before the first test that needs them (test_compiler.py's `whole_builds`), which then finds them in the cache. A
process of its own, because tests patch the environment and the contract that an in-process build would read."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from rawgpu.runtime import compiler

ARCHS = ("sm_80", "sm_86", "sm_90")


def build(archs=ARCHS) -> dict:
    """(source, arch) -> the compiled module, from the cache where it holds the build."""
    jobs = sorted(((s, a) for s in compiler.all_sources() for a in archs),
                  key=lambda sa: -(compiler.SOURCE_DIR / sa[0]).stat().st_size)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(jobs, pool.map(lambda sa: compiler.compile_source(*sa), jobs)))


if __name__ == "__main__":
    try:
        build()
    except Exception as exc:  # the fixture builds again in the test process and reports it there
        print(f"whole_builds: {exc}", file=sys.stderr)
        sys.exit(1)
