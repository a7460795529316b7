"""The backend registry: one table for the settings' names, the CLI and make_backend."""

from __future__ import annotations

import argparse
import typing

from polca import cli
from polca.gpu.config import BackendName, GpuSettings
from polca.gpu.nvml import NvmlBackend
from polca.gpu.registry import BACKEND_NAMES, BACKENDS, make_backend
from polca.gpu.simulated import SimulatedBackend


def test_the_registry_covers_exactly_the_settings_names() -> None:
    """Every name the settings accept builds a backend, and nothing else is registered."""
    assert set(BACKENDS) == set(typing.get_args(BackendName))
    assert BACKEND_NAMES == ("nvml", "simulated")  # the order --help lists them in


def test_cli_backend_choices_come_from_the_registry() -> None:
    """Both --backend options (agent, gpu probe) offer the registry's names."""
    parser = cli._parser()
    for path in (("agent",), ("gpu", "probe")):
        command = parser
        for name in path:
            (sub,) = (a for a in command._actions if isinstance(a, argparse._SubParsersAction))
            command = sub.choices[name]
        (backend,) = (a for a in command._actions if "--backend" in a.option_strings)
        assert backend.choices == BACKEND_NAMES, path


def test_make_backend_builds_what_the_settings_say() -> None:
    """The simulated backend gets the settings' count, model and seed; nvml is not opened."""
    sim = make_backend(GpuSettings(backend="simulated", simulated_count=3, simulated_seed=7))
    assert isinstance(sim, SimulatedBackend)
    assert len(sim.discover()) == 3
    assert sim.model.name == "H100-SXM"
    assert isinstance(make_backend(GpuSettings(backend="nvml")), NvmlBackend)
