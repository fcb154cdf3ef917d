#!/usr/bin/env bash
export PYTHONPATH=. RAWGPU_DATA=$PWD/.data/mnist RAWGPU_CACHE=/tmp/rawgpu-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for r in default adam; do for b in 1024 4096; do
  timeout -k 5 140 python3 scripts/bench.py train --recipe $r --batch $b --sizes 256 1024 4096 8192 --steps 100 \
     --peers jax-fori --out $OUT/b_${r}_$b 2>>$OUT/bench_err.log | grep -v floor | tee -a $OUT/bench.log
  rm -f $OUT/b_${r}_$b/*.png
done; done
