#!/usr/bin/env bash
# Everything a GPU session must verify, in one device call: GPU info, all tests (GPU ones included), timings.
# Usage on the device: bash scripts/gpu_check.sh [extra pytest args]. Logs go to $OUT when it is set.
set -uo pipefail
usage() {
    cat <<'USAGE'
usage: bash scripts/gpu_check.sh [PYTEST_ARGS...]

Everything a GPU session must verify, from any directory: the GPU and driver, the whole test suite (GPU tests
included; PYTEST_ARGS are passed to pytest), a warm-cache session, a cold and a warm training run, the graph
inspector and the benchmark (BENCH_ARGS overrides its arguments), and on several GPUs the split runs.
Logs go to $OUT (default /tmp/rawgpu-out). Exit status: pytest's; 1 without a usable GPU.
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
OUT=${OUT:-/tmp/rawgpu-out}; OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) || exit 1  # where it was started from
cd "$(dirname "$0")/.." || exit 1  # the repository root, wherever it was started from
export PYTHONPATH=.:scripts${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RAWGPU_DATA=${RAWGPU_DATA:-.data/mnist} OUT
# No GPU: one line and exit 1, before anything runs (the checks below need one).
if ! why=$(python3 -c "
import sys
from rawgpu import driver
from rawgpu.errors import RawgpuError
try:
    print(driver.device_count())
except RawgpuError as exc:
    sys.exit(str(exc))
" 2>&1); then
    echo "gpu_check: error: ${why##*$'\n'}" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import cuda.bindings, numpy; from rawgpu import compiler; print('cuda-bindings', cuda.bindings.__version__, 'nvrtc', compiler.nvrtc_version(), 'numpy', numpy.__version__)"
python3 -m pytest -q -rs "$@" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
python3 - <<'PY' 2>&1 | tee "$OUT/warm_cache.log"
import time
from rawgpu.recipe import Recipe
from rawgpu.session import Session
Session(Recipe()).close()  # the default recipe's units, built if the cache lacks them
t = time.perf_counter()
session = Session(Recipe())
print(f"warm-cache session of the default recipe: {session.compile_note}; whole set-up "
      f"{(time.perf_counter() - t) * 1e3:.0f} ms")
session.close()
PY
# The product, as a user runs it: a first run with an empty kernel cache (says it compiles), then the default
# recipe with a warm cache, timed as a whole process; then the graph inspector.
RAWGPU_CACHE=$(mktemp -d) /usr/bin/time -f "whole process: %e s wall" python3 -m rawgpu.train --steps 100 > "$OUT/cold_start.log" 2>&1
grep "kernels:\|trained\|whole process" "$OUT/cold_start.log"
/usr/bin/time -f "whole process: %e s wall" python3 -m rawgpu.train 2>&1 | tee "$OUT/train_default.log"
python3 scripts/inspect_graph.py --out "$OUT/step.dot" --format none 2>&1 | tee "$OUT/inspect_graph.log"
python3 scripts/bench.py ${BENCH_ARGS:-train --quick --out $OUT} 2>"$OUT/bench_stderr.log" | tee "$OUT/bench.log"
# On a machine with several GPUs (and NCCL): the seed and default recipes at large widths, split as `auto` splits
# them (tensor parallel there), then a small model at a large batch (data parallel), each beside one GPU.
gpus=$(python3 -c "from rawgpu import driver; from rawgpu.parallel import nccl
print(driver.device_count() if nccl.available() is None else 1)")
if [ "${gpus:-1}" -gt 1 ]; then
    counts="1 2 $( [ "$gpus" -ge 4 ] && echo 4 ) $( [ "$gpus" -ge 8 ] && echo 8 )"
    for recipe in seed default; do
        python3 scripts/bench.py train --gpus $counts --recipe $recipe --sizes 4096 8192 16384 --steps 1000 \
            --out "$OUT/gpus_$recipe" 2>>"$OUT/bench_stderr.log" | tee -a "$OUT/bench_gpus.log"
    done
    python3 scripts/bench.py train --gpus $counts --recipe default --batch 4096 --sizes 256 1024 --steps 300 \
        --out "$OUT/gpus_batch4096" 2>>"$OUT/bench_stderr.log" | tee -a "$OUT/bench_gpus.log"
fi
exit $status
