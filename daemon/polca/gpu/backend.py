"""The one narrow seam between polca and GPU hardware.

``GpuBackend`` is synchronous on purpose: the NVML implementation blocks in the driver and
must run on a single worker thread (see ``polca.gpu.threaded``), while the simulated one is
pure Python. Everything above this module sees only the frozen value types defined here.

Units: power in milliwatts (NVML's unit) inside polca, energy in millijoules, clocks in MHz,
temperatures in degrees Celsius. Conversions to W/J happen only at the edges (YAML, MQTT).
A field the GPU does not support is ``None`` in every sample; discovering support happens
once, in ``discover()``, never per tick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

# NVML clock event (throttle) reason bits, as published in telemetry.
CLOCK_EVENT_GPU_IDLE = 0x1
CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING = 0x2
CLOCK_EVENT_SW_POWER_CAP = 0x4
CLOCK_EVENT_HW_SLOWDOWN = 0x8
CLOCK_EVENT_SYNC_BOOST = 0x10
CLOCK_EVENT_SW_THERMAL_SLOWDOWN = 0x20
CLOCK_EVENT_HW_THERMAL_SLOWDOWN = 0x40
CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN = 0x80
CLOCK_EVENT_DISPLAY_CLOCK_SETTING = 0x100

CLOCK_EVENT_NAMES: dict[int, str] = {
    CLOCK_EVENT_GPU_IDLE: "gpu_idle",
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING: "applications_clocks_setting",
    CLOCK_EVENT_SW_POWER_CAP: "sw_power_cap",
    CLOCK_EVENT_HW_SLOWDOWN: "hw_slowdown",
    CLOCK_EVENT_SYNC_BOOST: "sync_boost",
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN: "sw_thermal_slowdown",
    CLOCK_EVENT_HW_THERMAL_SLOWDOWN: "hw_thermal_slowdown",
    CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
    CLOCK_EVENT_DISPLAY_CLOCK_SETTING: "display_clock_setting",
}


def clock_event_names(mask: int) -> tuple[str, ...]:
    """Name the bits set in an NVML clock event reason mask, lowest bit first."""
    return tuple(name for bit, name in CLOCK_EVENT_NAMES.items() if mask & bit)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Which reads and writes a GPU supports, discovered once at start-up."""

    power_instant: bool = False
    power_average: bool = False
    energy: bool = False
    gpu_temp: bool = False
    mem_temp: bool = False
    sm_clock: bool = False
    mem_clock: bool = False
    utilization: bool = False
    power_limit_read: bool = False
    enforced_power_limit: bool = False
    clock_event_reasons: bool = False
    power_limit_write: bool = False
    sm_clock_lock: bool = False


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device of a physical GPU: a compute instance inside a GPU instance.

    Its identity is ``uuid`` (``MIG-...``, what CUDA_VISIBLE_DEVICES and the Kubernetes device
    plugin hand to workloads). A MIG device has no power limit, clocks or temperature of its
    own: those belong to the parent GPU (``parent_index``/``parent_uuid``), which is what
    polca samples and caps.
    """

    uuid: str
    parent_index: int
    parent_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    # The MIG profile, e.g. "1g.10gb" or "3g.40gb" (from the MIG device's NVML name); None
    # when the driver does not name it.
    profile: str | None = None
    memory_mib: int | None = None  # memory of its GPU instance (shared by its compute instances)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """Static identity and constraints of one GPU (identity is the UUID, not the index).

    MIG: ``mig_enabled`` is the GPU's current MIG mode (what the driver enforces now);
    ``mig_pending`` is the mode after the next GPU reset; ``mig_supported`` is False on GPUs
    without MIG. While MIG is enabled the GPU refuses clock control, so
    ``capabilities.sm_clock_lock`` is False and power limits (on this, the parent GPU) are
    the only cap. ``mig_devices`` are the MIG devices found at discovery (they can be
    created and destroyed without a reset: ``MigReader.mig_devices`` reads them again).
    """

    index: int
    uuid: str
    name: str
    capabilities: Capabilities
    pci_bus_id: str | None = None
    power_limit_min_mw: int | None = None
    power_limit_max_mw: int | None = None
    power_limit_default_mw: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    # Valid SM clock values for lock calls, highest first; empty when unknown.
    supported_sm_clocks_mhz: tuple[int, ...] = field(default=())
    mig_supported: bool = False
    mig_enabled: bool = False
    mig_pending: bool = False
    mig_devices: tuple[MigDevice, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of one GPU. Every measured field is ``None`` when unsupported."""

    index: int
    uuid: str
    ts_ns: int
    power_mw: int | None = None  # instantaneous
    power_avg_mw: int | None = None  # driver-averaged (about 1 s)
    energy_mj: int | None = None  # total since driver load, monotonic
    gpu_temp_c: float | None = None
    mem_temp_c: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    power_limit_mw: int | None = None  # requested (management) limit
    enforced_power_limit_mw: int | None = None  # after every limiter, in- and out-of-band
    clock_event_reasons: int | None = None  # bitmask, see CLOCK_EVENT_*
    # The SM clock lock this backend last applied, as (min, max) MHz; None when unlocked.
    locked_sm_clocks_mhz: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """The health counters of one GPU, read once per telemetry interval (``health()``).

    Every field is ``None`` where the GPU or driver does not report it. Counts are totals:
    the XID events since the backend opened; ECC errors since the driver loaded
    (volatile) or over the GPU's life (aggregate); retired pages and remapped rows over its
    life; PCIe replays since the driver loaded; throttle times, cumulative, in ns.
    Flags are 0 or 1.
    """

    index: int
    uuid: str
    xid_errors: int | None = None
    last_xid: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: int | None = None
    row_remap_failure: int | None = None
    pcie_replays: int | None = None
    power_brake_ns: int | None = None
    hw_thermal_slowdown_ns: int | None = None
    sw_thermal_slowdown_ns: int | None = None


HEALTH_COUNTERS: tuple[str, ...] = tuple(
    f.name for f in fields(GpuHealth) if f.name not in {"index", "uuid"}
)
"""``GpuHealth``'s counters, in order (everything but the identity)."""


@runtime_checkable
class GpuBackend(Protocol):
    """Synchronous access to the GPUs of one node.

    Errors are raised as ``polca.errors.Gpu*Error``: ``GpuLostError`` for a GPU that fell
    off the bus, ``GpuPermissionError`` for a write without privilege, ``GpuLibraryError``
    when the management library cannot be used at all.
    """

    def discover(self) -> Sequence[GpuInfo]:
        """Open the library, enumerate GPUs and discover their capabilities (once)."""
        ...

    def sample(self, index: int) -> GpuSample:
        """Read every supported field of GPU ``index``."""
        ...

    def health(self, index: int) -> GpuHealth:
        """Read the health counters of GPU ``index`` (unsupported ones are ``None``)."""
        ...

    def check_write_access(self) -> None:
        """Raise ``GpuPermissionError`` (with how to fix it) unless writes are allowed."""
        ...

    def set_power_limit_mw(self, index: int, limit_mw: int) -> None:
        """Set the power management limit of GPU ``index`` (within its constraints)."""
        ...

    def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock of GPU ``index`` to the range [min_mhz, max_mhz]."""
        ...

    def reset_sm_clocks(self, index: int) -> None:
        """Remove any SM clock lock on GPU ``index``."""
        ...

    def close(self) -> None:
        """Release the library; idempotent."""
        ...


@runtime_checkable
class MigReader(Protocol):
    """A backend that can list the MIG devices of a GPU now (an optional extension).

    Not part of ``GpuBackend``: backends without MIG (the simulator) need not implement it;
    use ``read_mig_devices``, which answers ``()`` for them.
    """

    def mig_devices(self, index: int) -> tuple[MigDevice, ...]:
        """The MIG devices of GPU ``index`` now; ``()`` when MIG is off or unsupported."""
        ...


def read_mig_devices(backend: GpuBackend, index: int) -> tuple[MigDevice, ...]:
    """The MIG devices of GPU ``index`` through ``backend``; ``()`` if it has no MIG reader.

    Synchronous (it may call the driver): run it on the GPU thread, e.g.
    ``await gpu.run(read_mig_devices, gpu.backend, index)``.
    """
    if isinstance(backend, MigReader):
        return backend.mig_devices(index)
    return ()


def mig_parent(infos: Sequence[GpuInfo], uuid: str) -> GpuInfo | None:
    """The GPU that holds the MIG device ``uuid`` (as discovered), or None if none does.

    A plain GPU UUID maps to that GPU, so callers can resolve either kind of device id.
    """
    for info in infos:
        if info.uuid == uuid or any(mig.uuid == uuid for mig in info.mig_devices):
            return info
    return None


# --- writes, as data -------------------------------------------------------------------
#
# The agent plans what to write (pure, on the event loop) and the hardware seam executes
# it (``ThreadedGpu.write``, on the GPU thread); a new kind of action is one more class
# here with its ``execute``.


@dataclass(frozen=True, slots=True)
class LockSmClocks:
    """Lock the SM clock of GPU ``index`` to [``min_mhz``, ``max_mhz``]."""

    index: int
    min_mhz: int
    max_mhz: int

    def execute(self, backend: GpuBackend) -> None:
        """Do it through ``backend``."""
        backend.lock_sm_clocks_mhz(self.index, self.min_mhz, self.max_mhz)


@dataclass(frozen=True, slots=True)
class ResetSmClocks:
    """Remove any SM clock lock of GPU ``index``."""

    index: int

    def execute(self, backend: GpuBackend) -> None:
        """Do it through ``backend``."""
        backend.reset_sm_clocks(self.index)


@dataclass(frozen=True, slots=True)
class SetPowerLimit:
    """Set the power limit of GPU ``index``; the limit is read back right after."""

    index: int
    limit_mw: int

    def execute(self, backend: GpuBackend) -> None:
        """Do it through ``backend``."""
        backend.set_power_limit_mw(self.index, self.limit_mw)


GpuWrite = LockSmClocks | ResetSmClocks | SetPowerLimit
"""Every kind of write polca makes to a GPU."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What one write did: ``error`` when it failed, the read-back sample after a limit."""

    write: GpuWrite
    error: Exception | None = None
    readback: GpuSample | None = None


def execute_writes(
    backend: GpuBackend, batches: Sequence[Sequence[GpuWrite]]
) -> list[list[WriteResult]]:
    """Each GPU's writes in order through ``backend``; a GPU's first failure ends its writes.

    Synchronous: ``ThreadedGpu.write`` runs it on the GPU thread. Every exception is an
    outcome (one GPU's surprise must not stop the others' writes).
    """
    out: list[list[WriteResult]] = []
    for batch in batches:
        results: list[WriteResult] = []
        for write in batch:
            try:
                write.execute(backend)
                readback = backend.sample(write.index) if isinstance(write, SetPowerLimit) else None
            except Exception as exc:
                results.append(WriteResult(write, exc))
                break
            results.append(WriteResult(write, None, readback))
        out.append(results)
    return out
