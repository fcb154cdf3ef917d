"""Peer systems for `scripts/bench.py train`: the frameworks a user would pick instead of rawgpu, same workload."""
