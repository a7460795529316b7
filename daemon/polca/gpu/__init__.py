"""GPU access: one synchronous backend seam (NVML or simulated) and its async adapter."""

from polca.gpu.backend import Capabilities, GpuBackend, GpuInfo, GpuSample

__all__ = ["Capabilities", "GpuBackend", "GpuInfo", "GpuSample"]
