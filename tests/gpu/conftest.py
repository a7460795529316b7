"""Fixtures of the GPU backend tests: the fake NVML library (see tests/fake_nvml)."""

from tests.fake_nvml.plugin import fake_nvml, fake_nvml_lib

__all__ = ["fake_nvml", "fake_nvml_lib"]
