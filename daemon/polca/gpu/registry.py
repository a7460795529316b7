"""Which GPU backend a name builds: the one table of backends.

``gpu.backend`` in the settings names a backend (``polca.settings.BackendName``); this
module maps every name to a factory that builds that backend from ``GpuSettings``, so the
settings' type, the command line's ``--backend`` choices (``BACKEND_NAMES``) and what
``make_backend`` can build are one list and cannot drift apart: the table is typed with
the settings' names and a test checks it covers exactly them. A new backend is one more
entry here and one more name there.

Factories import their backend when called: ``nvml`` loads pynvml and ``simulated`` the
simulator, and the command line builds its parser from this table without either (it
imports nothing but this module, whose settings imports are for type checking only).
Building opens nothing (no I/O in constructors): the agent calls ``discover()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from polca.gpu.backend import GpuBackend
    from polca.gpu.config import BackendName, GpuSettings

    BackendFactory: TypeAlias = Callable[[GpuSettings], GpuBackend]


def _nvml(settings: GpuSettings) -> GpuBackend:
    """Real GPUs through NVML (``polca.gpu.nvml``)."""
    from polca.gpu.nvml import NvmlBackend  # noqa: PLC0415 - pynvml only when chosen

    return NvmlBackend()


def _simulated(settings: GpuSettings) -> GpuBackend:
    """The built-in simulated node (``polca.gpu.simulated``), as the settings describe it."""
    from polca.gpu.simulated import SimulatedBackend  # noqa: PLC0415 - only when chosen

    return SimulatedBackend(
        count=settings.simulated_count,
        model=settings.simulated_model,
        load=settings.simulated_load,
        seed=settings.simulated_seed,
    )


BACKENDS: Mapping[BackendName, BackendFactory] = {
    "nvml": _nvml,
    "simulated": _simulated,
}
"""Every backend name and the factory that builds it, in the order the CLI lists them."""

BACKEND_NAMES: tuple[BackendName, ...] = tuple(BACKENDS)
"""The names, for ``--backend`` choices."""


def make_backend(settings: GpuSettings) -> GpuBackend:
    """The GPU backend ``settings.backend`` names (constructed, not yet opened)."""
    return BACKENDS[settings.backend](settings)


__all__ = ["BACKENDS", "BACKEND_NAMES", "make_backend"]
