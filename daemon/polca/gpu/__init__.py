"""GPU access: one synchronous backend seam (NVML or simulated) and its async adapter.

``registry`` names the backends and builds the one the settings choose; what simulated GPUs
run and how they respond are ``polca.workload`` and ``polca.physics``, not this package.
"""

from polca.gpu.backend import Capabilities, GpuBackend, GpuInfo, GpuSample

__all__ = ["Capabilities", "GpuBackend", "GpuInfo", "GpuSample"]
