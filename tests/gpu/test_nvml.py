"""NvmlBackend through the real pynvml binding and the fake libnvidia-ml.so.1.

These tests pin what a mock of pynvml could not: C symbol names, struct layouts, per-entry
field return codes, and the error codes NVML really returns. The fake is loaded into this
process once (pynvml keeps its library in a module global); each test gets its own state
file. Scenarios that need a fresh process (no library at all, another process driving the
state) run in a subprocess.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from structlog.testing import capture_logs

from polca.errors import (
    FatalError,
    GpuError,
    GpuInvalidArgumentError,
    GpuLibraryError,
    GpuLostError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuTransientError,
)
from polca.gpu.backend import CLOCK_EVENT_SW_POWER_CAP, GpuBackend
from polca.gpu.nvml import NvmlBackend, translate_nvml_error
from tests.fake_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_DATA,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeNvml,
    supported_clocks,
)

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    """A backend over the in-process fake, closed after the test."""
    nvml = NvmlBackend()
    yield nvml
    nvml.close()


# ---- discovery and identity -------------------------------------------------------------


def test_constructor_does_no_io(fake_nvml: FakeNvml) -> None:
    """Constructing the backend makes no NVML call."""
    fake_nvml.reset_call_counts()
    nvml = NvmlBackend()
    assert fake_nvml.call_count() == 0
    nvml.close()
    assert fake_nvml.call_count() == 0


def test_backend_satisfies_the_protocol() -> None:
    """NvmlBackend is a GpuBackend."""
    assert isinstance(NvmlBackend(), GpuBackend)


def test_discover_identifies_gpus_by_uuid(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Every GPU is found with the UUID, name and PCI bus id NVML reports."""
    fake_nvml.set(6, uuid="GPU-12345678-abcd-ef01-2345-6789abcdef01")
    infos = backend.discover()
    assert [info.index for info in infos] == list(range(8))
    assert infos[6].uuid == "GPU-12345678-abcd-ef01-2345-6789abcdef01"
    assert infos[0].uuid == fake_nvml.get(0)["uuid"]
    assert len({info.uuid for info in infos}) == 8
    assert {info.name for info in infos} == {H100}
    assert infos[1].pci_bus_id == "00000000:28:00.0"
    assert backend.driver_version == "560.35.03"


def test_discover_reads_constraints_and_clocks(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Limits come in mW, clocks in MHz, supported SM clocks highest first."""
    fake_nvml.set(0, power_limit_min_mw=150_000, power_limit_default_mw=650_000)
    info = backend.discover()[0]
    assert info.power_limit_min_mw == 150_000
    assert info.power_limit_max_mw == 700_000
    assert info.power_limit_default_mw == 650_000
    assert info.sm_clock_max_mhz == 1980
    assert info.mem_clock_max_mhz == 2619
    assert info.supported_sm_clocks_mhz == tuple(supported_clocks(H100))
    assert info.supported_sm_clocks_mhz[0] == 1980
    assert list(info.supported_sm_clocks_mhz) == sorted(info.supported_sm_clocks_mhz, reverse=True)
    caps = info.capabilities
    assert all(
        (caps.power_instant, caps.power_average, caps.energy, caps.mem_temp, caps.utilization)
    )
    assert all((caps.power_limit_write, caps.sm_clock_lock))


def test_supported_clocks_come_from_the_highest_memory_clock(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """Graphics clocks are asked for at the highest memory clock (others are NOT_FOUND)."""
    fake_nvml.set(0, supported_mem_clocks=[810, 2619, 1593], supported_sm_clocks=[900, 1500])
    assert backend.discover()[0].supported_sm_clocks_mhz == (1500, 900)


def test_discover_twice_returns_the_same_gpus(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A second discover() answers from memory."""
    first = backend.discover()
    fake_nvml.reset_call_counts()
    assert backend.discover() == first
    assert fake_nvml.call_count() == 0


# ---- sampling ---------------------------------------------------------------------------


def test_sample_reports_nvml_units(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Power in mW, energy in mJ, temperatures in °C, clocks in MHz, utilisation in %."""
    fake_nvml.set(
        2,
        power_mw=412_345,
        power_avg_mw=398_765,
        energy_mj=123_456_789_012,
        gpu_temp_c=61,
        mem_temp_c=72,
        sm_clock_mhz=1755,
        mem_clock_mhz=2619,
        util_gpu_pct=87,
        util_mem_pct=33,
        power_limit_mw=600_000,
        clock_event_reasons=0x1,
    )
    backend.discover()
    sample = backend.sample(2)
    assert sample.index == 2
    assert sample.uuid == fake_nvml.get(2)["uuid"]
    assert sample.power_mw == 412_345
    assert sample.power_avg_mw == 398_765
    assert sample.energy_mj == 123_456_789_012  # an unsigned long long field, not 32-bit
    assert sample.gpu_temp_c == 61.0
    assert sample.mem_temp_c == 72.0
    assert sample.sm_clock_mhz == 1755
    assert sample.mem_clock_mhz == 2619
    assert sample.gpu_util_pct == 87.0
    assert sample.mem_util_pct == 33.0
    assert sample.power_limit_mw == 600_000
    assert sample.enforced_power_limit_mw == 600_000
    assert sample.clock_event_reasons == 0x1
    assert sample.locked_sm_clocks_mhz is None


def test_sample_makes_one_field_values_round_trip(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """Power, energy and memory temperature come from a single GetFieldValues call."""
    backend.discover()
    fake_nvml.reset_call_counts()
    backend.sample(0)
    assert fake_nvml.call_count("nvmlDeviceGetFieldValues") == 1
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage") == 0
    assert fake_nvml.call_count("nvmlDeviceGetTotalEnergyConsumption") == 0
    assert fake_nvml.call_count() == 8


def test_sample_keeps_the_driver_timestamp(backend: NvmlBackend) -> None:
    """ts_ns is the field values' microsecond timestamp, in ns."""
    backend.discover()
    before_ns = time.time_ns()
    sample = backend.sample(0)
    after_ns = time.time_ns()
    assert sample.ts_ns % 1000 == 0
    assert before_ns - 1000 <= sample.ts_ns <= after_ns


def test_sample_sees_state_changes(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Quick successive edits of the fake's state all reach the next sample."""
    backend.discover()
    for power_mw in (100_000, 100_001, 100_002):
        fake_nvml.set(4, power_mw=power_mw)
        assert backend.sample(4).power_mw == power_mw


def test_unsupported_memory_temperature_is_none(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A per-entry NOT_SUPPORTED turns the capability off and the field into None."""
    fake_nvml.set(1, mem_temp_c=None)
    infos = backend.discover()
    assert infos[1].capabilities.mem_temp is False
    assert infos[0].capabilities.mem_temp is True
    sample = backend.sample(1)
    assert sample.mem_temp_c is None
    assert sample.power_mw is not None
    assert backend.sample(0).mem_temp_c == 62.0


def test_unsupported_read_is_never_made_per_tick(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A call NOT_SUPPORTED at discovery is switched off: no call, no error, None."""
    fake_nvml.inject("nvmlDeviceGetUtilizationRates", NVML_ERROR_NOT_SUPPORTED, gpu=3)
    infos = backend.discover()
    assert infos[3].capabilities.utilization is False
    fake_nvml.reset_call_counts()
    sample = backend.sample(3)
    assert sample.gpu_util_pct is None
    assert sample.mem_util_pct is None
    assert fake_nvml.call_count("nvmlDeviceGetUtilizationRates") == 0
    assert backend.sample(2).gpu_util_pct == 90.0


def test_missing_function_is_unsupported(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """FUNCTION_NOT_FOUND (an older driver) counts as unsupported, not as a failure."""
    fake_nvml.inject("nvmlDeviceGetCurrentClocksEventReasons", 13)
    info = backend.discover()[0]
    assert info.capabilities.clock_event_reasons is False
    assert backend.sample(0).clock_event_reasons is None


def test_instant_power_falls_back_to_power_usage(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Without the instant-power field, power comes from nvmlDeviceGetPowerUsage."""
    fake_nvml.fail_field(0, 186, NVML_ERROR_NOT_SUPPORTED)
    fake_nvml.set(0, power_avg_mw=333_000)
    info = backend.discover()[0]
    assert info.capabilities.power_instant is True
    fake_nvml.reset_call_counts()
    assert backend.sample(0).power_mw == 333_000
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage") == 1


def test_transient_failure_costs_only_its_field(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """NO_DATA on one read (after discovery) leaves that field None, the rest intact."""
    backend.discover()
    fake_nvml.inject("nvmlDeviceGetTemperatureV", NVML_ERROR_NO_DATA, gpu=5)
    fake_nvml.fail_field(5, 82, NVML_ERROR_NO_DATA)
    sample = backend.sample(5)
    assert sample.gpu_temp_c is None
    assert sample.mem_temp_c is None
    assert sample.power_mw == 350_000


def test_sample_fails_when_every_read_fails(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """When no read at all succeeds, the transient error is raised, chained."""
    backend.discover()
    fake_nvml.set(2, error=NVML_ERROR_UNKNOWN)
    with pytest.raises(GpuTransientError) as caught:
        backend.sample(2)
    assert caught.value.index == 2
    assert caught.value.code == NVML_ERROR_UNKNOWN
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)


def test_clock_event_reasons_show_a_power_cap(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """Demand above the limit reads as SW_POWER_CAP, and power is held at the limit."""
    fake_nvml.set(0, power_mw=690_000, power_limit_mw=500_000)
    backend.discover()
    sample = backend.sample(0)
    assert sample.clock_event_reasons is not None
    assert sample.clock_event_reasons & CLOCK_EVENT_SW_POWER_CAP
    assert sample.power_mw == 500_000


# ---- writes -----------------------------------------------------------------------------


def test_power_limit_set_and_reset(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A set limit lands in the GPU's state, is enforced, and can be set back."""
    info = backend.discover()[1]
    backend.set_power_limit_mw(1, 450_000)
    assert fake_nvml.get(1)["power_limit_mw"] == 450_000
    sample = backend.sample(1)
    assert sample.power_limit_mw == 450_000
    assert sample.enforced_power_limit_mw == 450_000
    assert fake_nvml.get(0)["power_limit_mw"] == 700_000
    assert info.power_limit_default_mw is not None
    backend.set_power_limit_mw(1, info.power_limit_default_mw)
    assert fake_nvml.get(1)["power_limit_mw"] == 700_000


def test_enforced_limit_follows_an_external_limiter(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """An out-of-band limit below ours shows in the enforced limit only."""
    backend.discover()
    backend.set_power_limit_mw(0, 600_000)
    fake_nvml.set(0, external_limit_mw=400_000)
    sample = backend.sample(0)
    assert sample.power_limit_mw == 600_000
    assert sample.enforced_power_limit_mw == 400_000


def test_out_of_range_limit_is_invalid(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """NVML refuses a limit outside its constraints; the backend does not clamp it."""
    backend.discover()
    with pytest.raises(GpuInvalidArgumentError) as caught:
        backend.set_power_limit_mw(0, 900_000)
    assert caught.value.index == 0
    assert caught.value.code == 2
    assert fake_nvml.get(0)["power_limit_mw"] == 700_000


def test_clock_lock_and_reset(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A lock reaches the GPU, caps its clock and shows in the sample; reset removes it."""
    backend.discover()
    backend.lock_sm_clocks_mhz(4, 1200, 1410)
    state = fake_nvml.get(4)
    assert (state["locked_min_mhz"], state["locked_max_mhz"]) == (1200, 1410)
    sample = backend.sample(4)
    assert sample.sm_clock_mhz == 1410
    assert sample.locked_sm_clocks_mhz == (1200, 1410)
    assert backend.sample(3).locked_sm_clocks_mhz is None
    backend.reset_sm_clocks(4)
    state = fake_nvml.get(4)
    assert (state["locked_min_mhz"], state["locked_max_mhz"]) == (0, 0)
    sample = backend.sample(4)
    assert sample.sm_clock_mhz == 1980
    assert sample.locked_sm_clocks_mhz is None


def test_inverted_clock_range_is_invalid(backend: NvmlBackend) -> None:
    """min above max is refused by NVML and leaves no lock recorded."""
    backend.discover()
    with pytest.raises(GpuInvalidArgumentError):
        backend.lock_sm_clocks_mhz(0, 1500, 1000)
    assert backend.sample(0).locked_sm_clocks_mhz is None


# ---- errors -----------------------------------------------------------------------------


def test_lost_gpu_raises_while_others_sample(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """GPU_IS_LOST on one GPU raises GpuLostError(index) there and nowhere else."""
    backend.discover()
    fake_nvml.lose(3)
    with pytest.raises(GpuLostError) as caught:
        backend.sample(3)
    assert caught.value.index == 3
    assert caught.value.code == NVML_ERROR_GPU_IS_LOST
    assert isinstance(caught.value.__cause__, pynvml.NVMLError_GpuIsLost)
    with pytest.raises(GpuLostError):
        backend.set_power_limit_mw(3, 500_000)
    for index in (0, 1, 2, 4, 5, 6, 7):
        assert backend.sample(index).power_mw == 350_000


@pytest.mark.parametrize("code", [15, 16, 28])
def test_every_lost_code_is_a_lost_gpu(
    fake_nvml: FakeNvml, backend: NvmlBackend, code: int
) -> None:
    """GPU_IS_LOST, RESET_REQUIRED and GPU_NOT_FOUND all mean the GPU is gone."""
    backend.discover()
    fake_nvml.lose(7, code)
    with pytest.raises(GpuLostError) as caught:
        backend.sample(7)
    assert caught.value.code == code


def test_gpu_lost_at_discovery_is_left_out(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A GPU lost before discovery is logged and skipped; the others are controlled."""
    fake_nvml.lose(5)
    with capture_logs() as logs:
        infos = backend.discover()
    assert [info.index for info in infos] == [0, 1, 2, 3, 4, 6, 7]
    assert any(log["event"] == "gpu_lost_at_discovery" and log["gpu"] == 5 for log in logs)
    with pytest.raises(GpuLostError) as caught:
        backend.sample(5)
    assert caught.value.index == 5


def test_check_write_access_without_privilege_says_how_to_fix(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """NO_PERMISSION becomes a fatal GpuPermissionError naming CAP_SYS_ADMIN and the fixes."""
    fake_nvml.set(privileged=False)
    backend.discover()
    with pytest.raises(GpuPermissionError) as caught:
        backend.check_write_access()
    message = str(caught.value)
    for fix in (
        "CAP_SYS_ADMIN",
        "AmbientCapabilities=CAP_SYS_ADMIN",
        "CapabilityBoundingSet=CAP_SYS_ADMIN",
        "--cap-add SYS_ADMIN",
        "observe_only",
        "POLCA_AGENT__OBSERVE_ONLY=1",
    ):
        assert fix in message
    assert isinstance(caught.value, FatalError)
    assert isinstance(caught.value.__cause__, pynvml.NVMLError_NoPermission)


def test_check_write_access_with_privilege_changes_nothing(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """The access check writes GPU 0's current limit back unchanged."""
    fake_nvml.set(0, power_limit_mw=555_000)
    backend.discover()
    fake_nvml.reset_call_counts()
    backend.check_write_access()
    assert fake_nvml.call_count("nvmlDeviceSetPowerManagementLimit") == 1
    assert fake_nvml.get(0)["power_limit_mw"] == 555_000


def test_writes_without_privilege_raise_permission_error(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """Every write refused for privilege raises GpuPermissionError for that GPU."""
    backend.discover()
    fake_nvml.set(privileged=False)
    with pytest.raises(GpuPermissionError, match="CAP_SYS_ADMIN"):
        backend.set_power_limit_mw(2, 400_000)
    with pytest.raises(GpuPermissionError) as caught:
        backend.lock_sm_clocks_mhz(2, 1000, 1000)
    assert caught.value.index == 2
    assert backend.sample(2).locked_sm_clocks_mhz is None
    with pytest.raises(GpuPermissionError):
        backend.reset_sm_clocks(2)


def test_v2_power_limit_binding_swallows_errors(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    """nvidia-ml-py 13.615.71's SetPowerManagementLimit_v2 hides NO_PERMISSION; v1 does not.

    This documents the binding bug the backend avoids by calling the v1 function.
    """
    backend.discover()
    fake_nvml.set(privileged=False)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    fake_nvml.reset_call_counts()
    returned = pynvml.nvmlDeviceSetPowerManagementLimit_v2(
        handle, pynvml.NVML_POWER_SCOPE_GPU, 400_000
    )
    assert returned == pynvml.NVML_SUCCESS  # the bug: the C call failed ...
    assert fake_nvml.call_count("nvmlDeviceSetPowerManagementLimit_v2") == 1
    assert fake_nvml.get(0)["power_limit_mw"] == 700_000  # ... and nothing changed
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 400_000)


def test_driver_not_loaded_is_a_library_error(fake_nvml: FakeNvml) -> None:
    """DRIVER_NOT_LOADED at init is fatal and says what to check."""
    fake_nvml.inject("nvmlInitWithFlags", NVML_ERROR_DRIVER_NOT_LOADED)
    nvml = NvmlBackend()
    with pytest.raises(GpuLibraryError, match="kernel driver") as caught:
        nvml.discover()
    assert isinstance(caught.value, FatalError)
    assert caught.value.code == NVML_ERROR_DRIVER_NOT_LOADED
    nvml.close()


def test_library_missing_is_a_library_error(tmp_path: Path) -> None:
    """Without libnvidia-ml.so.1, discover() raises GpuLibraryError with the fix."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real NVML library is installed on this machine")
    script = textwrap.dedent(
        """
        from polca.errors import GpuLibraryError
        from polca.gpu.nvml import NvmlBackend
        try:
            NvmlBackend().discover()
        except GpuLibraryError as exc:
            print(type(exc.__cause__).__name__, exc.code, exc)
        """
    )
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("NVMLError_LibraryNotFound 12 ")
    assert "libnvidia-ml.so.1 was not found" in result.stdout
    assert "--backend simulated" in result.stdout


def test_uninitialised_use_is_a_library_error(fake_nvml: FakeNvml) -> None:
    """Sampling before discover() or after close() raises GpuLibraryError."""
    nvml = NvmlBackend()
    with pytest.raises(GpuLibraryError):
        nvml.sample(0)
    nvml.discover()
    nvml.close()
    with pytest.raises(GpuLibraryError):
        nvml.sample(0)
    with pytest.raises(GpuLibraryError):
        nvml.check_write_access()


def test_unknown_index_is_invalid(backend: NvmlBackend) -> None:
    """An index NVML never reported is an invalid argument, not a lost GPU."""
    backend.discover()
    with pytest.raises(GpuInvalidArgumentError):
        backend.sample(8)


def test_close_is_idempotent_and_shuts_nvml_down(fake_nvml: FakeNvml) -> None:
    """close() releases the one NVML reference once; a second close() is a no-op."""
    nvml = NvmlBackend()
    nvml.discover()
    assert fake_nvml.init_count() == 1
    nvml.close()
    assert fake_nvml.init_count() == 0
    nvml.close()
    assert fake_nvml.init_count() == 0
    nvml.discover()
    assert fake_nvml.init_count() == 1
    nvml.close()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (15, GpuLostError),
        (16, GpuLostError),
        (28, GpuLostError),
        (4, GpuPermissionError),
        (3, GpuNotSupportedError),
        (13, GpuNotSupportedError),
        (2, GpuInvalidArgumentError),
        (24, GpuInvalidArgumentError),
        (10, GpuTransientError),
        (19, GpuTransientError),
        (21, GpuTransientError),
        (23, GpuTransientError),
        (27, GpuTransientError),
        (999, GpuTransientError),
        (1, GpuLibraryError),
        (9, GpuLibraryError),
        (12, GpuLibraryError),
        (18, GpuLibraryError),
    ],
)
def test_error_table(code: int, expected: type[GpuError]) -> None:
    """Each NVML code maps to the polca error the caller acts on, with index and code."""
    error = translate_nvml_error(pynvml.NVMLError(code), call="nvmlDeviceGetX", index=6)
    assert type(error) is expected
    assert error.index == 6
    assert error.code == code
    assert "nvmlDeviceGetX failed on GPU 6" in str(error)


def test_unlisted_code_is_a_plain_gpu_error() -> None:
    """A code outside the table still becomes a GpuError, never a bare NVMLError."""
    error = translate_nvml_error(pynvml.NVMLError(14), call="nvmlInit", index=None)
    assert type(error) is GpuError
    assert "failed on NVML" in str(error)


def test_fake_refuses_unknown_keys(fake_nvml: FakeNvml) -> None:
    """A typo in a fake key fails loudly instead of being ignored by the library."""
    with pytest.raises(KeyError, match="power_watts"):
        fake_nvml.set(0, power_watts=1)
    with pytest.raises(KeyError, match="gpu_temp_c"):
        fake_nvml.set(gpu_temp_c=50)  # a GPU key without a GPU


# ---- another process ----------------------------------------------------------------------

_DRIVER_SCRIPT = """
import sys

import structlog

from polca.gpu.nvml import NvmlBackend

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
nvml = NvmlBackend()
print(len(nvml.discover()), flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "sample":
        print(nvml.sample(int(command[1])).power_mw, flush=True)
    elif command[0] == "limit":
        nvml.set_power_limit_mw(int(command[1]), int(command[2]))
        print("ok", flush=True)
nvml.close()
"""


def test_another_process_is_driven_through_the_state_file(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """A process using the fake via LD_LIBRARY_PATH sees test edits; the test sees its writes."""
    with subprocess.Popen(
        [sys.executable, "-c", _DRIVER_SCRIPT],
        env=fake_nvml.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None

        def ask(command: str) -> str:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.write(f"{command}\n")
            proc.stdin.flush()
            return proc.stdout.readline().strip()

        try:
            assert proc.stdout.readline().strip() == "8"
            assert ask("sample 2") == "350000"
            fake_nvml.set(2, power_mw=123_456)
            assert ask("sample 2") == "123456"
            assert ask("limit 2 300000") == "ok"
            assert fake_nvml.get(2)["power_limit_mw"] == 300_000
            assert ask("sample 2") == "123456"
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""


def test_gpu_check_script_runs_against_the_fake(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    """bench/gpu_check.py completes on the fake, confirms the _v2 bug and restores the GPU."""
    out = tmp_path / "gpu_check.json"
    argv = [sys.executable, "bench/gpu_check.py", "--out", str(out), "--agent-seconds", "0"]
    argv += ["--iterations", "20", "--window-s", "0.05", "--settle-s", "2"]
    argv += ["--profile-out", str(tmp_path / "profile.yaml")]
    result = subprocess.run(
        argv,
        env=fake_nvml.env(),
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert "fatal" not in report
    assert report["gpu"]["name"] == H100
    assert report["reads"]["nvmlDeviceGetFieldValues[186,185,82,191]"]["n"] == 20
    assert report["reads"]["NvmlBackend.sample"]["n"] == 20
    assert report["power_limit"]["target_mw"] == 300_000
    assert report["power_limit"]["enforced_after_ms"] is not None
    assert report["clock_lock"]["sm_clock_locked_mhz"] == report["clock_lock"]["target_mhz"]
    assert report["v2_binding_bug"]["bug_confirmed"] is True
    assert report["v2_binding_bug"]["c_function_returned"] == 2
    assert report["restore"]["gpu0_clocks"] == "reset"
    # No torch here: the sweep says so and no profile is written (the fit is tested alone).
    assert report["sweep"] == {"skipped": "torch not installed"}
    assert not (tmp_path / "profile.yaml").exists()
    state = fake_nvml.get(0)
    assert state["power_limit_mw"] == 700_000
    assert (state["locked_min_mhz"], state["locked_max_mhz"]) == (0, 0)
