"""GPU health counters through NvmlBackend, the real pynvml and the fake libnvidia-ml.so.1:
field values by id, XID events through an event set, unsupported counters as None."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from polca.errors import GpuLostError
from polca.gpu.backend import HEALTH_COUNTERS
from polca.gpu.nvml import NvmlBackend
from tests.fake_nvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, FakeNvml


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    """A backend over the in-process fake, closed after the test."""
    nvml = NvmlBackend()
    yield nvml
    nvml.close()


def test_counters_are_read_by_field_id(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Every counter comes from its NVML field; a healthy GPU reads zeros, not None."""
    fake_nvml.set(
        1,
        ecc_sbe_vol=7,
        ecc_dbe_vol=1,
        ecc_sbe_agg=70,
        ecc_dbe_agg=2,
        retired_sbe=3,
        retired_dbe=4,
        retired_pending=1,
        pcie_replay=12,
        remapped_cor=5,
        remapped_unc=6,
        remapped_pending=1,
        remapped_failure=0,
        sw_thermal_ns=2_500_000_000,
        hw_thermal_ns=1_000,
        power_brake_ns=9_000_000_000,
    )
    backend.discover()
    healthy = backend.health(0)
    assert all(getattr(healthy, name) == 0 for name in HEALTH_COUNTERS if name != "last_xid")
    assert healthy.last_xid is None
    h = backend.health(1)
    assert h.uuid == fake_nvml.get(1)["uuid"]
    assert (h.ecc_corrected_volatile, h.ecc_uncorrected_volatile) == (7, 1)
    assert (h.ecc_corrected_aggregate, h.ecc_uncorrected_aggregate) == (70, 2)
    assert (h.retired_pages_sbe, h.retired_pages_dbe, h.retired_pages_pending) == (3, 4, 1)
    assert h.pcie_replays == 12
    assert (h.remapped_rows_correctable, h.remapped_rows_uncorrectable) == (5, 6)
    assert (h.row_remap_pending, h.row_remap_failure) == (1, 0)
    assert h.sw_thermal_slowdown_ns == 2_500_000_000
    assert h.hw_thermal_slowdown_ns == 1_000
    assert h.power_brake_ns == 9_000_000_000


def test_xid_events_are_counted_per_gpu(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """XIDs raised after discovery are counted on their own GPU with the last code."""
    fake_nvml.set(2, xid_count=5)  # before polca started: not polca's to count
    fake_nvml.reset_call_counts()
    backend.discover()
    assert backend.health(2).xid_errors == 0
    fake_nvml.xid(2, 79)
    fake_nvml.xid(2, 48)
    fake_nvml.xid(3, 13)
    assert (backend.health(2).xid_errors, backend.health(2).last_xid) == (2, 48)
    h3 = backend.health(3)
    assert (h3.xid_errors, h3.last_xid) == (1, 13)
    assert backend.health(0).xid_errors == 0
    assert fake_nvml.call_count("nvmlDeviceRegisterEvents") == 8


def test_unsupported_counters_are_none(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A counter the GPU does not report is None in every reading, never zero."""
    fake_nvml.set(0, ecc_sbe_vol=None, power_brake_ns=None, xid_count=None)
    backend.discover()
    h = backend.health(0)
    assert h.ecc_corrected_volatile is None
    assert h.power_brake_ns is None
    assert h.xid_errors is None
    assert h.ecc_uncorrected_volatile == 0
    assert backend.health(1).xid_errors == 0


def test_no_event_sets_leaves_xids_unknown(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A driver without event sets still gives the field counters."""
    fake_nvml.inject("nvmlEventSetCreate", NVML_ERROR_NOT_SUPPORTED)
    backend.discover()
    h = backend.health(0)
    assert h.xid_errors is None
    assert h.pcie_replays == 0


def test_lost_gpu_raises(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Health on a GPU that fell off the bus is GpuLostError, like a sample."""
    backend.discover()
    fake_nvml.lose(4, NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GpuLostError):
        backend.health(4)
    assert backend.health(5).xid_errors == 0


def test_close_frees_the_event_set(fake_nvml: FakeNvml) -> None:
    """close() frees the event set; a second discover() registers again."""
    fake_nvml.reset_call_counts()
    nvml = NvmlBackend()
    nvml.discover()
    nvml.close()
    assert fake_nvml.call_count("nvmlEventSetFree") == 1
    nvml.discover()
    fake_nvml.xid(0, 31)
    assert nvml.health(0).xid_errors == 1
    nvml.close()
