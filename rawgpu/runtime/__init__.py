"""The runtime: the NVIDIA driver (driver.py: the one module that calls it), NVRTC (compiler.py), the arena
(memory.py), CUDA graphs (graph.py), NCCL (nccl.py: the one module that calls it), the ranks' processes (ranks.py),
errors, atomic files and install hints. Knows nothing of models.
"""
