"""Measurement machinery shared by scripts/bench.py and the experiments in dev/: one way of timing, so their figures
compare. timing: CUDA events around graph replays, the copy-bandwidth and launch floors; gemm: the GEMMs and one-pass
backwards of a step, alone, on operand copies past the L2; training: the benchmark's recipes and the timed training
run. Nothing in the product imports it; the peers (PyTorch and JAX trainers) stay in scripts/peers."""
