"""The GPU backend's settings (``gpu:``): which backend, and the simulated one's model.

Here, beside the hardware seam, because the seam's registry (``registry.py``) builds a
backend from them; the agent's settings (``agent/config.py``) hold them as ``gpu``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polca.settings import Group

BackendName = Literal["nvml", "simulated"]
"""The GPU backends ``gpu.backend`` can name; ``polca.gpu.registry`` builds each of them.

Defined here because settings sit below the hardware seam; the registry's table is typed
with it and a test checks that the table covers exactly these names.
"""


class GpuSettings(Group):
    """The GPU backend."""

    backend: BackendName = Field(
        "nvml", description="nvml for real GPUs, simulated for the built-in GPU model."
    )
    simulated_count: int = Field(8, ge=1, le=64, description="GPUs of the simulated backend.")
    simulated_model: str = Field(
        "H100-SXM", description="Simulated GPU model preset (A100-SXM4, H100-SXM, H200-SXM)."
    )
    simulated_load: str = Field(
        "inference",
        description="Simulated load profile: idle, constant, inference, ramp or square.",
    )
    simulated_seed: int = Field(0, description="Seed of the simulated load and noise.")
    call_timeout_s: float = Field(
        2.0, gt=0, description="A GPU call taking longer than this is reported as stuck."
    )
