"""GPU physics shared by polca's two simulations: presets and the power/clock curve.

The simulated backend (``polca.gpu.simulated``, a node behind the hardware seam) and the row
simulator (``polca.sim``, a whole row under the policy engine) model the same GPUs; what
they share lives here once: the GPU presets (``presets``: power limits, clocks, idle power,
thermal constants) and how power moves with the SM clock and a power limit (``power``).
What only one of them needs stays with it: the backend's thermal model, sensor noise and
NVML behaviour; the simulator's per-phase serving model. Pure data and arithmetic: no I/O,
no numpy import, no other polca module.
"""

from polca.physics.presets import MODEL_NAMES, GpuModel, get_model

__all__ = ["MODEL_NAMES", "GpuModel", "get_model"]
