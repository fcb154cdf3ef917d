"""The command lines, thin layers over the Python API: train (with train_run.py and train_rank.py), evaluate, predict,
compile, sweep, launch; the console; what they share (common.py). `python -m rawgpu.X` runs cli/X.py.
"""
