#!/usr/bin/env bash
# Experiment: run named concurrency experiments in order on the device, stopping at the first that hangs (a hung
# GPU spoils every later one): then the kernel log's NVRM/Xid lines and a probe of whether the GPU still runs work.
# Usage (repository root, on the device): bash dev/concurrency/sequence.sh [-n PROCS] NAME ...
#   chain-VARIANT    dev/concurrency/pdl_chain.py --variant VARIANT, PROCS copies at once
#   train-RECIPE     python -m rawgpu.train, PROCS copies at once; RECIPE: default, seed, adam, fused, cluster,
#                    nooverlap, nograph (the default recipe with --no-overlap / --no-graph)
#   plain-WORDS      the default recipe with overlap taken off the kernels named by WORDS (a,b: train_partial_overlap.py)
# Not part of the product (dev/README.md).
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RAWGPU_DATA=${RAWGPU_DATA:-.data/mnist}
procs=4
if [ "${1:-}" = "-n" ]; then procs=$2; shift 2; fi
many="timeout -k 5 120 python3 dev/concurrency/many.py --procs $procs --timeout 40"
steps="--steps ${STEPS:-20000}"
for name in "$@"; do
    case $name in
        chain-*) $many --label "$name" -- python3 dev/concurrency/pdl_chain.py --variant "${name#chain-}" --seconds 4 ;;
        train-default) $many --label "$name" -- python3 -m rawgpu.train --hidden 256 $steps --seed '{i}' ;;
        train-seed) $many --label "$name" -- python3 -m rawgpu.train --hidden 128 --batch 32 --momentum 0 --lr 0.003 \
            --schedule constant $steps --seed '{i}' ;;
        train-adam) $many --label "$name" -- python3 -m rawgpu.train --hidden 256 --optimizer adam $steps --seed '{i}' ;;
        train-fused) $many --label "$name" -- python3 -m rawgpu.train --hidden 256 --step fused $steps --seed '{i}' ;;
        train-cluster) $many --label "$name" -- python3 -m rawgpu.train --hidden 128 --batch 32 --momentum 0 \
            --lr 0.003 --schedule constant --step cluster $steps --seed '{i}' ;;
        train-nooverlap) $many --label "$name" -- python3 -m rawgpu.train --hidden 256 --no-overlap $steps --seed '{i}' ;;
        train-nograph) $many --label "$name" -- python3 -m rawgpu.train --hidden 256 --no-graph $steps --seed '{i}' ;;
        plain-*) $many --label "$name" -- python3 dev/concurrency/train_partial_overlap.py --plain "${name#plain-}" -- \
            --hidden 256 $steps --seed '{i}' ;;
        *) echo "sequence: unknown experiment $name"; exit 2 ;;
    esac
    status=$?
    if [ $status -ge 3 ]; then
        echo "sequence: $name hung (exit $status): stopping here"
        dmesg 2>/dev/null | grep -iE "nvrm|xid" | tail -n 20
        timeout -k 2 20 python3 dev/concurrency/pdl_chain.py --variant serial --seconds 1 \
            || echo "sequence: probe: the GPU no longer runs a fresh process's work (exit $?)"
        exit $status
    fi
done
