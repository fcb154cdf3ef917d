set -o pipefail
export PYTHONPATH=. RAWGPU_DATA=$PWD/.data/mnist RAWGPU_CACHE=/tmp/rawgpu-cache PYTHONUNBUFFERED=1
for R in default adam; do for B in 384 512; do
  timeout -k 5 75 python3 scripts/bench.py train --recipe $R --batch $B --sizes 256 512 1024 --steps 200 --peers jax-fori --rawgpu-variants fused layered 2>&1 | grep -v "Warning\|warn\|floor\|wrote" | tee -a $OUT/bench.log
done; done
