"""rawgpu: a minimal GPU training runtime that talks to the NVIDIA driver directly."""

__version__ = "0.1.0"
