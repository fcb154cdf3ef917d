#!/usr/bin/env bash
# Experiment: N training processes on one GPU at once against the same N one after another, for each step kind.
# Usage (repository root, on the device): bash dev/concurrency/share.sh [N ...]   (default 2 4 8 16)
# Each line is many.py's summary: whether all finished, the wall time, and the training seconds summed over the
# copies (each run's own "trained ... in S s"). Every copy runs under a hard limit. Not part of the product.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RAWGPU_DATA=${RAWGPU_DATA:-.data/mnist}
counts=${*:-2 4 8 16}
seed="--hidden 128 --batch 32 --momentum 0 --lr 0.003 --schedule constant"
declare -A recipes=(
    [default]="--hidden 256"
    [adam]="--hidden 256 --optimizer adam"
    [fused]="--hidden 256 --step fused"
    [cluster]="$seed --step cluster"
)
for kind in default adam fused cluster; do
    args="${recipes[$kind]}"
    timeout -k 5 120 python3 -m rawgpu.train $args > /dev/null 2>&1  # fills the kernel cache
    for n in $counts; do
        for how in "" --serial; do
            timeout -k 5 400 python3 dev/concurrency/many.py --procs "$n" --timeout 300 $how --label "$kind" -- \
                python3 -m rawgpu.train $args --seed '{i}' | tail -n 1
        done
    done
done
