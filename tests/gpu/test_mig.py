"""MIG awareness of NvmlBackend, through the real pynvml binding and the fake libnvidia-ml.so.1.

A MIG-enabled GPU is still sampled and capped through its own (parent) handle; discovery
lists its MIG devices (UUIDs mapped to the parent), reports clock locks unusable, and the
power limit on the parent keeps working. A GPU without MIG, or with MIG off, is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest
from structlog.testing import capture_logs

from polca.errors import GpuLostError, GpuNotSupportedError
from polca.gpu.backend import (
    GpuBackend,
    LockSmClocks,
    MigDevice,
    MigReader,
    SetPowerLimit,
    execute_writes,
    mig_parent,
    read_mig_devices,
)
from polca.gpu.nvml import MAX_MIG_DEVICES, NvmlBackend, _mig_profile
from polca.gpu.simulated import SimulatedBackend
from tests.fake_nvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeMig,
    FakeNvml,
    mig_uuid,
)

MIG_GPU = 2
# Two profiles on an H100 80GB: two 1g.10gb instances (a gap at index 1) and one 3g.40gb.
SMALL_A = FakeMig(mig_uuid(MIG_GPU, 0), "1g.10gb", 9, 0, 9856)
SMALL_B = FakeMig(mig_uuid(MIG_GPU, 2), "1g.10gb", 10, 0, 9856)
LARGE = FakeMig(mig_uuid(MIG_GPU, 3), "3g.40gb", 2, 0, 40192)


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    """A backend over the in-process fake, closed after the test."""
    nvml = NvmlBackend()
    yield nvml
    nvml.close()


@pytest.fixture
def mig_fake(fake_nvml: FakeNvml) -> FakeNvml:
    """The 8-GPU fake with GPU 2 in MIG mode, holding MIG devices of two profiles."""
    fake_nvml.set_mig(MIG_GPU, [SMALL_A, None, SMALL_B, LARGE])
    return fake_nvml


# ---- MIG off, or no MIG at all -----------------------------------------------------------


def test_mig_disabled_gpu_is_unchanged(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A MIG-capable GPU with MIG off lists no MIG devices and still locks clocks."""
    fake_nvml.reset_call_counts()
    info = backend.discover()[0]
    assert (info.mig_supported, info.mig_enabled, info.mig_pending) == (True, False, False)
    assert info.mig_devices == ()
    assert info.capabilities.sm_clock_lock
    assert info.capabilities.utilization
    assert fake_nvml.call_count("nvmlDeviceGetMigDeviceHandleByIndex") == 0
    backend.lock_sm_clocks_mhz(0, 345, 1500)
    assert fake_nvml.get(0)["locked_max_mhz"] == 1500
    assert backend.mig_devices(0) == ()


def test_gpu_without_mig_support_is_mig_disabled(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """NOT_SUPPORTED from GetMigMode (no MIG on this GPU) is simply MIG off, not a failure."""
    fake_nvml.set(1, mig_mode=None)
    with capture_logs() as logs:
        info = backend.discover()[1]
    assert (info.mig_supported, info.mig_enabled) == (False, False)
    assert info.capabilities.sm_clock_lock
    assert not [log for log in logs if log["event"].startswith("gpu_mig")]


def test_missing_mig_symbols_are_mig_disabled(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A driver without nvmlDeviceGetMigMode (FUNCTION_NOT_FOUND) reads as no MIG."""
    fake_nvml.inject("nvmlDeviceGetMigMode", 13)
    infos = backend.discover()
    assert len(infos) == 8
    assert not any(info.mig_supported for info in infos)


def test_transient_mig_mode_failure_is_logged_and_read_as_off(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """An UNKNOWN error reading the MIG mode costs MIG awareness of that GPU, not discovery."""
    fake_nvml.inject("nvmlDeviceGetMigMode", NVML_ERROR_UNKNOWN, gpu=4)
    with capture_logs() as logs:
        infos = backend.discover()
    assert len(infos) == 8
    assert not infos[4].mig_enabled
    assert any(log["event"] == "gpu_mig_mode_unknown" and log["gpu"] == 4 for log in logs)


def test_pending_mig_mode_is_reported_but_not_enforced(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """MIG pending (after the next reset) is reported; until then clocks lock as before."""
    fake_nvml.set_mig(5, [], enabled=False, pending=True)
    with capture_logs() as logs:
        info = backend.discover()[5]
    assert (info.mig_enabled, info.mig_pending) == (False, True)
    assert info.capabilities.sm_clock_lock
    assert any(log["event"] == "gpu_mig" and log["pending"] for log in logs)


# ---- MIG on: discovery -----------------------------------------------------------------


def test_mig_devices_of_two_profiles_map_to_their_parent(
    mig_fake: FakeNvml, backend: NvmlBackend
) -> None:
    """Each MIG device is listed with its UUID, ids, profile and memory, under its parent."""
    infos = backend.discover()
    info = infos[MIG_GPU]
    assert (info.mig_supported, info.mig_enabled, info.mig_pending) == (True, True, True)
    parent_uuid = info.uuid
    assert info.mig_devices == (
        MigDevice(SMALL_A.uuid, MIG_GPU, parent_uuid, 9, 0, "1g.10gb", 9856),
        MigDevice(SMALL_B.uuid, MIG_GPU, parent_uuid, 10, 0, "1g.10gb", 9856),
        MigDevice(LARGE.uuid, MIG_GPU, parent_uuid, 2, 0, "3g.40gb", 40192),
    )
    assert all(mig.uuid.startswith("MIG-") for mig in info.mig_devices)
    assert mig_parent(infos, LARGE.uuid) is info
    assert mig_parent(infos, parent_uuid) is info
    assert mig_parent(infos, "MIG-00000000-0000-0000-0000-000000000000") is None
    # The other GPUs are untouched.
    assert [i.index for i in infos if i.mig_enabled] == [MIG_GPU]
    assert infos[MIG_GPU + 1].capabilities.sm_clock_lock


def test_mig_gpu_is_sampled_through_the_parent(mig_fake: FakeNvml, backend: NvmlBackend) -> None:
    """Power and temperature come from the parent; utilization (not on MIG GPUs) is None."""
    info = backend.discover()[MIG_GPU]
    assert not info.capabilities.utilization
    sample = backend.sample(MIG_GPU)
    assert sample.uuid == info.uuid
    assert sample.power_mw == 350_000
    assert sample.gpu_temp_c == 55.0
    assert sample.gpu_util_pct is None


def test_mig_enumeration_is_bounded_by_the_max_count(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """Only indices below GetMaxMigDeviceCount are asked for, whatever sits beyond."""
    fake_nvml.set_mig(MIG_GPU, [SMALL_A, SMALL_B, LARGE], max_devices=2)
    fake_nvml.reset_call_counts()
    info = backend.discover()[MIG_GPU]
    assert [mig.uuid for mig in info.mig_devices] == [SMALL_A.uuid, SMALL_B.uuid]
    assert fake_nvml.call_count("nvmlDeviceGetMigDeviceHandleByIndex") == 2


def test_a_huge_max_count_is_capped(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A nonsense max count from the driver costs at most MAX_MIG_DEVICES handle lookups."""
    fake_nvml.set_mig(MIG_GPU, [LARGE], max_devices=1_000_000)
    fake_nvml.reset_call_counts()
    info = backend.discover()[MIG_GPU]
    assert [mig.uuid for mig in info.mig_devices] == [LARGE.uuid]
    assert fake_nvml.call_count("nvmlDeviceGetMigDeviceHandleByIndex") == MAX_MIG_DEVICES


def test_unreadable_mig_device_is_skipped(mig_fake: FakeNvml, backend: NvmlBackend) -> None:
    """A MIG device that cannot be read (destroyed meanwhile) is logged and left out."""
    mig_fake.inject("nvmlDeviceGetGpuInstanceId", NVML_ERROR_INVALID_ARGUMENT, gpu=MIG_GPU)
    with capture_logs() as logs:
        info = backend.discover()[MIG_GPU]
    assert info.mig_enabled
    assert info.mig_devices == ()
    assert info.capabilities.sm_clock_lock is False
    skipped = [log for log in logs if log["event"] == "mig_device_unreadable"]
    assert [log["slot"] for log in skipped] == [0, 2, 3]


def test_gpu_lost_while_listing_mig_devices_is_left_out(
    mig_fake: FakeNvml, backend: NvmlBackend
) -> None:
    """GPU_IS_LOST during MIG enumeration marks that GPU lost; the others are discovered."""
    mig_fake.inject("nvmlDeviceGetMigDeviceHandleByIndex", NVML_ERROR_GPU_IS_LOST, gpu=MIG_GPU)
    infos = backend.discover()
    assert MIG_GPU not in [info.index for info in infos]
    with pytest.raises(GpuLostError):
        backend.sample(MIG_GPU)


def test_mig_devices_are_read_again_live(mig_fake: FakeNvml, backend: NvmlBackend) -> None:
    """Instances created or destroyed after discovery show in mig_devices(), not in GpuInfo."""
    info = backend.discover()[MIG_GPU]
    mig_fake.set_mig(MIG_GPU, [LARGE])
    assert [mig.uuid for mig in backend.mig_devices(MIG_GPU)] == [LARGE.uuid]
    assert [mig.uuid for mig in read_mig_devices(backend, MIG_GPU)] == [LARGE.uuid]
    assert len(info.mig_devices) == 3


def test_mig_reader_is_optional() -> None:
    """NvmlBackend reads MIG devices; a backend without a reader (the simulator) has none."""
    assert isinstance(NvmlBackend(), MigReader)
    simulated = SimulatedBackend(count=2)
    assert isinstance(simulated, GpuBackend)
    assert not isinstance(simulated, MigReader)
    infos = simulated.discover()
    assert read_mig_devices(simulated, 0) == ()
    assert not infos[0].mig_enabled
    assert infos[0].mig_devices == ()


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "1g.10gb"),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "3g.20gb"),
        ("NVIDIA H200 MIG 1g.18gb+me", "1g.18gb+me"),
        ("MIG 7g.80gb", "7g.80gb"),
        ("NVIDIA H100 80GB HBM3", None),
        (None, None),
    ],
)
def test_profile_comes_from_the_mig_device_name(name: str | None, profile: str | None) -> None:
    """The profile is what follows "MIG" in the MIG device's name; no "MIG", no profile."""
    assert _mig_profile(name) == profile


# ---- MIG on: writes ----------------------------------------------------------------------


def test_clock_lock_is_refused_under_mig(mig_fake: FakeNvml, backend: NvmlBackend) -> None:
    """The capability is off, and a lock anyway is GpuNotSupportedError saying why (MIG)."""
    info = backend.discover()[MIG_GPU]
    assert info.capabilities.sm_clock_lock is False
    assert info.capabilities.power_limit_write is True
    with pytest.raises(GpuNotSupportedError, match="MIG mode is enabled") as caught:
        backend.lock_sm_clocks_mhz(MIG_GPU, 345, 1500)
    assert caught.value.index == MIG_GPU
    assert caught.value.code == NVML_ERROR_NOT_SUPPORTED
    assert isinstance(caught.value.__cause__, GpuNotSupportedError)
    assert isinstance(caught.value.__cause__.__cause__, pynvml.NVMLError)
    assert mig_fake.get(MIG_GPU)["locked_max_mhz"] == 0
    assert backend.sample(MIG_GPU).locked_sm_clocks_mhz is None
    with pytest.raises(GpuNotSupportedError, match="cap its power limit instead"):
        backend.reset_sm_clocks(MIG_GPU)


def test_power_limit_on_the_mig_parent_still_applies(
    mig_fake: FakeNvml, backend: NvmlBackend
) -> None:
    """Setting the parent's power limit works under MIG and reads back as enforced."""
    info = backend.discover()[MIG_GPU]
    assert info.power_limit_min_mw == 200_000
    backend.set_power_limit_mw(MIG_GPU, 300_000)
    assert mig_fake.get(MIG_GPU)["power_limit_mw"] == 300_000
    sample = backend.sample(MIG_GPU)
    assert sample.power_limit_mw == 300_000
    assert sample.enforced_power_limit_mw == 300_000
    assert sample.power_mw == 300_000  # the fake's load is capped by the limit


def test_a_lock_first_in_a_batch_blocks_the_power_cap(
    mig_fake: FakeNvml, backend: NvmlBackend
) -> None:
    """Why the actuator must skip locks on a GPU without sm_clock_lock: the refused lock ends
    that GPU's batch, so a power limit planned after it is never written."""
    backend.discover()
    results = execute_writes(
        backend,
        [
            [LockSmClocks(MIG_GPU, 345, 1500), SetPowerLimit(MIG_GPU, 300_000)],
            [SetPowerLimit(MIG_GPU + 1, 300_000)],
        ],
    )
    assert isinstance(results[0][0].error, GpuNotSupportedError)
    assert len(results[0]) == 1
    assert mig_fake.get(MIG_GPU)["power_limit_mw"] == 700_000
    assert results[1][0].error is None
    only_power = execute_writes(backend, [[SetPowerLimit(MIG_GPU, 300_000)]])
    assert only_power[0][0].error is None
    assert mig_fake.get(MIG_GPU)["power_limit_mw"] == 300_000


# ---- the fake itself, through the raw binding ----------------------------------------------


def test_fake_answers_mig_handle_calls_like_nvml(mig_fake: FakeNvml, backend: NvmlBackend) -> None:
    """MIG handles: IsMigDeviceHandle, parent lookup, instance ids; GPU handles have no ids."""
    backend.discover()
    parent = pynvml.nvmlDeviceGetHandleByIndex(MIG_GPU)
    assert pynvml.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(pynvml.nvmlDeviceGetHandleByIndex(0)) == 0
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 3)
    # The binding returns the c_uint itself here, not its value.
    assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert pynvml.nvmlDeviceIsMigDeviceHandle(parent).value == 0
    assert pynvml.nvmlDeviceGetUUID(mig) == LARGE.uuid
    assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    back = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert pynvml.nvmlDeviceGetUUID(back) == pynvml.nvmlDeviceGetUUID(parent)
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == 2
    assert pynvml.nvmlDeviceGetComputeInstanceId(mig) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(parent)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 7)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPowerUsage(mig)  # a MIG handle has no power reading
    mig_fake.set_mig(MIG_GPU, [SMALL_A])  # the 3g.40gb instance is destroyed
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetUUID(mig)


def test_fake_refuses_application_clocks_under_mig(
    mig_fake: FakeNvml, backend: NvmlBackend
) -> None:
    """Applications clocks, like locked clocks, are NOT_SUPPORTED on a MIG-enabled GPU only."""
    backend.discover()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetApplicationsClocks(
            pynvml.nvmlDeviceGetHandleByIndex(MIG_GPU), 2619, 1500
        )
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceResetApplicationsClocks(pynvml.nvmlDeviceGetHandleByIndex(MIG_GPU))
    pynvml.nvmlDeviceSetApplicationsClocks(pynvml.nvmlDeviceGetHandleByIndex(0), 2619, 1500)
    assert mig_fake.get(0)["app_sm_clock_mhz"] == 1500
    assert mig_fake.mig_devices(MIG_GPU) == {0: SMALL_A, 2: SMALL_B, 3: LARGE}
