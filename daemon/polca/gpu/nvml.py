"""``NvmlBackend``: the ``GpuBackend`` for real NVIDIA GPUs, over NVIDIA's NVML binding.

This is the only module of polca that imports ``pynvml`` (nvidia-ml-py); an import-linter
contract keeps it so, and everything above the seam sees only ``polca.gpu.backend`` types.

What it does, and what it must not do:

- ``discover()`` opens NVML, identifies GPUs by UUID and tries every read once: a read the
  GPU does not support is switched off in ``Capabilities`` and its field is ``None`` in
  every later sample, so no tick ever pays for (or logs) a NOT_SUPPORTED again. A GPU that
  is already lost at discovery is left out (logged) and ``sample()`` on its index raises
  ``GpuLostError``, so the node keeps controlling the others.
- ``sample()`` reads power, energy and memory temperature in one ``GetFieldValues`` round
  trip (checking each entry's own return code) plus the calls that have no field.
- Every NVML error goes through one table, ``_ERRORS``, into ``polca.errors``, always
  chained with ``raise ... from exc``.
- It clamps and snaps nothing: limits and clocks are passed to NVML as given. Policy about
  allowed values lives in the actuator (see ``polca.gpu.clocks`` for snapping).
- It holds no lock and starts no thread: ``ThreadedGpu`` runs it on one worker thread.
- MIG: power, clocks and limits belong to the physical GPU, so every GPU is sampled and
  capped through its own (parent) handle, MIG or not. ``discover()`` reads the MIG mode
  (a GPU without MIG answers NOT_SUPPORTED: ``mig_supported`` False) and, while MIG is
  enabled, lists the MIG devices (at most ``GetMaxMigDeviceCount`` of them) into
  ``GpuInfo.mig_devices`` and reports ``sm_clock_lock`` False: NVML refuses clock control
  on a MIG-enabled GPU, and power limits on the parent are the cap that remains.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import pynvml
import structlog
from structlog.typing import FilteringBoundLogger

from polca.errors import (
    GpuError,
    GpuInvalidArgumentError,
    GpuLibraryError,
    GpuLostError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuTransientError,
)
from polca.gpu.backend import Capabilities, GpuHealth, GpuInfo, GpuSample, MigDevice

T = TypeVar("T")

FIELD_MEMORY_TEMP: Final = pynvml.NVML_FI_DEV_MEMORY_TEMP  # 82, degrees C
FIELD_POWER_AVERAGE: Final = pynvml.NVML_FI_DEV_POWER_AVERAGE  # 185, mW (about 1 s)
FIELD_POWER_INSTANT: Final = pynvml.NVML_FI_DEV_POWER_INSTANT  # 186, mW
FIELD_ENERGY: Final = pynvml.NVML_FI_DEV_ENERGY  # 191, mJ since driver load
SAMPLE_FIELDS: Final = (FIELD_POWER_INSTANT, FIELD_POWER_AVERAGE, FIELD_ENERGY, FIELD_MEMORY_TEMP)

HEALTH_FIELDS: Final[Mapping[int, str]] = {
    pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: "ecc_corrected_volatile",  # 3
    pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: "ecc_uncorrected_volatile",  # 4
    pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: "ecc_corrected_aggregate",  # 5
    pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: "ecc_uncorrected_aggregate",  # 6
    pynvml.NVML_FI_DEV_RETIRED_SBE: "retired_pages_sbe",  # 29
    pynvml.NVML_FI_DEV_RETIRED_DBE: "retired_pages_dbe",  # 30
    pynvml.NVML_FI_DEV_RETIRED_PENDING: "retired_pages_pending",  # 31
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: "pcie_replays",  # 94
    pynvml.NVML_FI_DEV_REMAPPED_COR: "remapped_rows_correctable",  # 142
    pynvml.NVML_FI_DEV_REMAPPED_UNC: "remapped_rows_uncorrectable",  # 143
    pynvml.NVML_FI_DEV_REMAPPED_PENDING: "row_remap_pending",  # 144
    pynvml.NVML_FI_DEV_REMAPPED_FAILURE: "row_remap_failure",  # 145
    # Cumulative throttle time in ns (drivers of the R570 branch and later).
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: "sw_thermal_slowdown_ns",  # 269
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: "hw_thermal_slowdown_ns",  # 270
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: "power_brake_ns",  # 271
}
"""The health counters read in one ``GetFieldValues`` per GPU (``health()``), by field id."""
XID_EVENT: Final = pynvml.nvmlEventTypeXidCriticalError
MAX_EVENTS_PER_READ: Final = 1024
"""XID events taken from the event set per ``health()`` call at most (a storm waits)."""

MAX_MIG_DEVICES: Final = 16
"""MIG device indices read per GPU at most, whatever the driver reports (7 on A100/H100/B200)."""
MIG_CLOCK_HINT: Final = (
    "MIG mode is enabled on this GPU and NVML refuses clock control on MIG-enabled GPUs: "
    "cap its power limit instead (it applies to the whole GPU, every MIG device included), "
    "or disable MIG (nvidia-smi -i <gpu> -mig 0, then a GPU reset)."
)
_MIG_PROFILE: Final = re.compile(r"(?:^|\s)MIG\s+(\S.*)$")

PERMISSION_FIX: Final = (
    "Setting power limits and locking clocks needs root or CAP_SYS_ADMIN. Fix one of: run "
    "polca as root or with CAP_SYS_ADMIN; under systemd put CapabilityBoundingSet=CAP_SYS_ADMIN "
    "and AmbientCapabilities=CAP_SYS_ADMIN in the [Service] section of polca-agent.service "
    "(or User=root); in a container add --cap-add SYS_ADMIN; or run read-only with "
    "agent.observe_only: true (POLCA_AGENT__OBSERVE_ONLY=1)."
)

_LOST_HINT: Final = (
    "The GPU fell off the bus or needs a reset (see dmesg for the Xid); drain the node and "
    "reset the GPU. polca stops commanding it and keeps controlling the others."
)
_LIBRARY_HINTS: Final = {
    "missing": "libnvidia-ml.so.1 was not found: install the NVIDIA driver on the host; in a "
    "container run with the NVIDIA Container Toolkit and NVIDIA_DRIVER_CAPABILITIES=utility; "
    "or use --backend simulated on a machine without GPUs.",
    "driver": "The NVIDIA kernel driver is not loaded: check `nvidia-smi` and "
    "`lsmod | grep nvidia`, and run nvidia-persistenced.",
    "mismatch": "The NVML library and the kernel driver have different versions (a driver "
    "upgrade without reboot): reload the nvidia kernel modules or reboot, then restart polca.",
    "uninitialized": "NVML is not initialised: the backend was closed or discover() never ran.",
}

# The one table from NVML return codes to polca errors (code -> error class, fix hint).
_ERRORS: Final[Mapping[int, tuple[type[GpuError], str]]] = {
    pynvml.NVML_ERROR_UNINITIALIZED: (GpuLibraryError, _LIBRARY_HINTS["uninitialized"]),
    pynvml.NVML_ERROR_INVALID_ARGUMENT: (GpuInvalidArgumentError, ""),
    pynvml.NVML_ERROR_NOT_SUPPORTED: (GpuNotSupportedError, ""),
    pynvml.NVML_ERROR_NO_PERMISSION: (GpuPermissionError, PERMISSION_FIX),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (GpuLibraryError, _LIBRARY_HINTS["driver"]),
    pynvml.NVML_ERROR_TIMEOUT: (GpuTransientError, ""),
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (GpuLibraryError, _LIBRARY_HINTS["missing"]),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (GpuNotSupportedError, "(driver too old for it)"),
    pynvml.NVML_ERROR_GPU_IS_LOST: (GpuLostError, _LOST_HINT),
    pynvml.NVML_ERROR_RESET_REQUIRED: (GpuLostError, _LOST_HINT),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (GpuLibraryError, _LIBRARY_HINTS["mismatch"]),
    pynvml.NVML_ERROR_IN_USE: (GpuTransientError, ""),
    pynvml.NVML_ERROR_MEMORY: (GpuTransientError, ""),
    pynvml.NVML_ERROR_NO_DATA: (GpuTransientError, ""),
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: (GpuTransientError, ""),
    pynvml.NVML_ERROR_FREQ_NOT_SUPPORTED: (GpuInvalidArgumentError, ""),
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: (GpuLibraryError, _LIBRARY_HINTS["mismatch"]),
    pynvml.NVML_ERROR_DEPRECATED: (GpuNotSupportedError, ""),
    pynvml.NVML_ERROR_NOT_READY: (GpuTransientError, ""),
    pynvml.NVML_ERROR_GPU_NOT_FOUND: (GpuLostError, _LOST_HINT),
    pynvml.NVML_ERROR_UNKNOWN: (GpuTransientError, ""),
}

# Per-tick failures that cost one field (None) rather than the whole sample.
_FIELD_LEVEL = (GpuNotSupportedError, GpuTransientError, GpuInvalidArgumentError)
# The fields of a sample that come from the GPU (the rest is identity and our own state).
_MEASURED: Final = tuple(
    f.name
    for f in dataclasses.fields(GpuSample)
    if f.name not in {"index", "uuid", "ts_ns", "locked_sm_clocks_mhz"}
)
# Discovery failures that mean "this read is not available here".
_UNAVAILABLE = (GpuNotSupportedError, GpuInvalidArgumentError, GpuPermissionError)


def translate_nvml_error(exc: pynvml.NVMLError, *, call: str, index: int | None) -> GpuError:
    """The polca error for an NVML error, by ``_ERRORS``; the caller raises it ``from exc``."""
    code = int(exc.value)
    error_class, hint = _ERRORS.get(code, (GpuError, ""))
    where = "NVML" if index is None else f"GPU {index}"
    msg = f"{call} failed on {where}: {exc} (NVML error {code})"
    if hint:
        msg = f"{msg}. {hint}"
    return error_class(msg, index=index, code=code)


def _call(fn: Callable[..., T], *args: Any, index: int | None) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise translate_nvml_error(exc, call=fn.__name__, index=index) from exc


def _field_number(entry: Any) -> int | float:
    value_type = entry.valueType
    value = entry.value
    if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(value.dVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(value.ulVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(value.ullVal)
    if value_type == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(value.sllVal)
    if value_type == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(value.siVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return int(value.usVal)
    return int(value.uiVal)


@dataclass(slots=True)
class _Gpu:
    """What the backend keeps per discovered GPU."""

    info: GpuInfo
    handle: Any
    fields: tuple[int, ...]  # field ids read each tick (the supported ones)
    power_from_usage: bool  # no instant-power field: fall back to GetPowerUsage
    energy_from_counter: bool  # no energy field: fall back to GetTotalEnergyConsumption
    locked_sm_clocks_mhz: tuple[int, int] | None = None  # NVML has no getter for the lock
    health_fields: tuple[int, ...] = ()  # the HEALTH_FIELDS this GPU answers
    xid_events: bool = False  # registered for XID events
    xid_errors: int = 0
    last_xid: int | None = None


@dataclass(slots=True)
class _Reads:
    """Bookkeeping of one sample: the first field-level failure, if any."""

    index: int
    first: tuple[GpuError, BaseException] | None = None

    def fail(self, error: GpuError, cause: BaseException) -> None:
        if self.first is None:
            self.first = (error, cause)


class NvmlBackend:
    """``GpuBackend`` over NVML. Construct freely: nothing happens before ``discover()``."""

    def __init__(self, *, logger: FilteringBoundLogger | None = None) -> None:
        """Keep the logger; NVML is opened by ``discover()``, not here."""
        self._log: FilteringBoundLogger = (
            logger if logger is not None else structlog.get_logger(__name__)
        )
        self._initialized = False
        self._gpus: dict[int, _Gpu] | None = None
        self._lost_at_discovery: set[int] = set()
        self._infos: tuple[GpuInfo, ...] = ()
        self._events: Any = None  # the XID event set, when the driver offers one
        self._by_handle: dict[int | None, int] = {}
        self.driver_version: str | None = None

    # ---- discovery ------------------------------------------------------------------

    def discover(self) -> Sequence[GpuInfo]:
        """Open NVML, enumerate the GPUs and discover what each supports (once).

        A second call returns the same GPUs without touching NVML.
        """
        if self._gpus is not None:
            return self._infos
        _call(pynvml.nvmlInit, index=None)
        self._initialized = True
        try:
            self.driver_version = self._optional(pynvml.nvmlSystemGetDriverVersion, index=None)
            count = int(_call(pynvml.nvmlDeviceGetCount, index=None))
            gpus: dict[int, _Gpu] = {}
            for index in range(count):
                try:
                    gpus[index] = self._discover_gpu(index)
                except GpuLostError as exc:
                    self._lost_at_discovery.add(index)
                    self._log.error("gpu_lost_at_discovery", gpu=index, error=str(exc))
        except BaseException:
            self.close()
            raise
        self._gpus = gpus
        self._infos = tuple(gpu.info for gpu in gpus.values())
        self._register_xid_events(gpus)
        self._log.info(
            "nvml_opened",
            driver_version=self.driver_version,
            gpus=len(gpus),
            lost=sorted(self._lost_at_discovery),
        )
        return self._infos

    def _optional(self, fn: Callable[..., T], *args: Any, index: int | None) -> T | None:
        """One read that may be unavailable here: its value, or None."""
        try:
            return _call(fn, *args, index=index)
        except _UNAVAILABLE:
            return None

    def _probe(self, fn: Callable[..., T], *args: Any, index: int) -> tuple[bool, T | None]:
        """Try a read once at discovery: (supported, value).

        A transient failure counts as supported (the read will be tried each tick);
        lost GPUs and library failures propagate.
        """
        try:
            return True, _call(fn, *args, index=index)
        except _UNAVAILABLE:
            return False, None
        except GpuTransientError as exc:
            self._log.warning("gpu_probe_transient", gpu=index, call=fn.__name__, error=str(exc))
            return True, None

    def _discover_gpu(self, index: int) -> _Gpu:
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index, index=index)
        uuid = str(_call(pynvml.nvmlDeviceGetUUID, handle, index=index))
        name = str(_call(pynvml.nvmlDeviceGetName, handle, index=index))
        pci = self._optional(pynvml.nvmlDeviceGetPciInfo_v3, handle, index=index)
        fields = self._probe_fields(handle, index)
        power_instant = FIELD_POWER_INSTANT in fields
        power_from_usage = False
        if not power_instant:
            power_instant = power_from_usage = self._probe(
                pynvml.nvmlDeviceGetPowerUsage, handle, index=index
            )[0]
        energy = FIELD_ENERGY in fields
        energy_from_counter = False
        if not energy:
            energy = energy_from_counter = self._probe(
                pynvml.nvmlDeviceGetTotalEnergyConsumption, handle, index=index
            )[0]
        sm_clock = self._probe(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM,
                               index=index)[0]  # fmt: skip
        limit_read = self._probe(pynvml.nvmlDeviceGetPowerManagementLimit, handle, index=index)[0]
        constraints = self._optional(
            pynvml.nvmlDeviceGetPowerManagementLimitConstraints, handle, index=index
        )
        default_mw = self._optional(
            pynvml.nvmlDeviceGetPowerManagementDefaultLimit, handle, index=index
        )
        sm_max_mhz = self._optional(
            pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM, index=index
        )
        mem_max_mhz = self._optional(
            pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM, index=index
        )
        supported = self._supported_sm_clocks(handle, index)
        mig_supported, mig_enabled, mig_pending = self._mig_mode(handle, index)
        mig_devices = self._read_mig_devices(handle, index, uuid) if mig_enabled else ()
        capabilities = Capabilities(
            power_instant=power_instant,
            power_average=FIELD_POWER_AVERAGE in fields,
            energy=energy,
            gpu_temp=self._probe(
                pynvml.nvmlDeviceGetTemperatureV, handle, pynvml.NVML_TEMPERATURE_GPU, index=index
            )[0],
            mem_temp=FIELD_MEMORY_TEMP in fields,
            sm_clock=sm_clock,
            mem_clock=self._probe(
                pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM, index=index
            )[0],
            utilization=self._probe(pynvml.nvmlDeviceGetUtilizationRates, handle, index=index)[0],
            power_limit_read=limit_read,
            enforced_power_limit=self._probe(
                pynvml.nvmlDeviceGetEnforcedPowerLimit, handle, index=index
            )[0],
            clock_event_reasons=self._probe(
                pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle, index=index
            )[0],
            # Writes cannot be probed without writing: assume them where the matching
            # reads work; a write the GPU refuses raises GpuNotSupportedError then.
            power_limit_write=limit_read and constraints is not None,
            # A MIG-enabled GPU refuses clock locks (NOT_SUPPORTED): power limits only.
            sm_clock_lock=not mig_enabled
            and sm_clock
            and (bool(supported) or sm_max_mhz is not None),
        )
        info = GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            capabilities=capabilities,
            pci_bus_id=_bus_id(pci),
            power_limit_min_mw=None if constraints is None else int(constraints[0]),
            power_limit_max_mw=None if constraints is None else int(constraints[1]),
            power_limit_default_mw=None if default_mw is None else int(default_mw),
            sm_clock_max_mhz=None if sm_max_mhz is None else int(sm_max_mhz),
            mem_clock_max_mhz=None if mem_max_mhz is None else int(mem_max_mhz),
            supported_sm_clocks_mhz=supported,
            mig_supported=mig_supported,
            mig_enabled=mig_enabled,
            mig_pending=mig_pending,
            mig_devices=mig_devices,
        )
        if mig_enabled or mig_pending:
            self._log.info(
                "gpu_mig",
                gpu=index,
                uuid=uuid,
                enabled=mig_enabled,
                pending=mig_pending,
                devices=[f"{mig.uuid} {mig.profile}" for mig in mig_devices],
            )
        unsupported = [name for name, ok in _capability_items(capabilities) if not ok]
        if unsupported:
            self._log.info("gpu_capabilities", gpu=index, uuid=uuid, unsupported=unsupported)
        return _Gpu(
            info=info,
            handle=handle,
            fields=fields,
            power_from_usage=power_from_usage,
            energy_from_counter=energy_from_counter,
            health_fields=self._probe_fields(handle, index, HEALTH_FIELDS),
        )

    def _mig_mode(self, handle: Any, index: int) -> tuple[bool, bool, bool]:
        """(supported, enabled now, enabled after the next reset) of GPU ``index``.

        NOT_SUPPORTED (a GPU without MIG) or a missing symbol (an old driver) is "no MIG".
        A failure that may pass is logged and read as MIG off, so clock locks are still
        tried (and refused by the driver if MIG is on after all).
        """
        try:
            current, pending = _call(pynvml.nvmlDeviceGetMigMode, handle, index=index)
        except _UNAVAILABLE:
            return False, False, False
        except GpuTransientError as exc:
            self._log.warning("gpu_mig_mode_unknown", gpu=index, error=str(exc))
            return False, False, False
        enabled = pynvml.NVML_DEVICE_MIG_ENABLE
        return True, int(current) == enabled, int(pending) == enabled

    def _read_mig_devices(self, handle: Any, index: int, parent_uuid: str) -> tuple[MigDevice, ...]:
        """The MIG devices under GPU ``index``, by MIG device index (bounded).

        An index without a compute instance (NOT_FOUND) is skipped; so is a MIG device that
        vanishes while it is read (instances come and go without a GPU reset). A lost GPU
        or an unusable library propagates.
        """
        count = self._optional(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle, index=index)
        devices: list[MigDevice] = []
        for slot in range(min(int(count or 0), MAX_MIG_DEVICES)):
            try:
                mig = _call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot, index=index)
                device = self._mig_device(mig, index, parent_uuid)
            except (GpuLostError, GpuLibraryError):
                raise
            except GpuError as exc:
                if exc.code != pynvml.NVML_ERROR_NOT_FOUND:
                    self._log.warning("mig_device_unreadable", gpu=index, slot=slot, error=str(exc))
                continue
            if device is not None:
                devices.append(device)
        return tuple(devices)

    def _mig_device(self, mig: Any, index: int, parent_uuid: str) -> MigDevice | None:
        """One MIG device from its handle; None when NVML names another parent."""
        uuid = str(_call(pynvml.nvmlDeviceGetUUID, mig, index=index))
        parent = self._optional(
            pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, mig, index=index
        )
        if parent is not None:
            seen = str(_call(pynvml.nvmlDeviceGetUUID, parent, index=index))
            if seen != parent_uuid:
                self._log.warning("mig_device_elsewhere", gpu=index, mig=uuid, parent=seen)
                return None
        name = self._optional(pynvml.nvmlDeviceGetName, mig, index=index)
        memory = self._optional(pynvml.nvmlDeviceGetMemoryInfo, mig, index=index)
        return MigDevice(
            uuid=uuid,
            parent_index=index,
            parent_uuid=parent_uuid,
            gpu_instance_id=int(_call(pynvml.nvmlDeviceGetGpuInstanceId, mig, index=index)),
            compute_instance_id=int(_call(pynvml.nvmlDeviceGetComputeInstanceId, mig, index=index)),
            profile=_mig_profile(None if name is None else str(name)),
            memory_mib=None if memory is None else int(memory.total) // (1024 * 1024),
        )

    def mig_devices(self, index: int) -> tuple[MigDevice, ...]:
        """The MIG devices of GPU ``index`` now (``MigReader``); ``()`` when MIG is off.

        MIG devices can be created and destroyed while the GPU stays in MIG mode, so this
        reads them again; the MIG mode itself changes only with a GPU reset (rediscover).
        """
        gpu = self._gpu(index)
        if not gpu.info.mig_enabled:
            return ()
        return self._read_mig_devices(gpu.handle, index, gpu.info.uuid)

    def _register_xid_events(self, gpus: Mapping[int, _Gpu]) -> None:
        """One event set for every GPU that reports XID errors (none: XIDs stay None)."""
        try:
            events = _call(pynvml.nvmlEventSetCreate, index=None)
        except (*_UNAVAILABLE, GpuTransientError) as exc:
            self._log.info("xid_events_unavailable", error=str(exc))
            return
        for index, gpu in gpus.items():
            supported = self._optional(
                pynvml.nvmlDeviceGetSupportedEventTypes, gpu.handle, index=index
            )
            if not supported or not int(supported) & XID_EVENT:
                continue
            try:
                _call(pynvml.nvmlDeviceRegisterEvents, gpu.handle, XID_EVENT, events, index=index)
            except (*_UNAVAILABLE, GpuTransientError) as exc:
                self._log.info("xid_events_unavailable", gpu=index, error=str(exc))
                continue
            gpu.xid_events = True
            self._by_handle[_address(gpu.handle)] = index
        self._events = events

    def _probe_fields(
        self, handle: Any, index: int, ids: Sequence[int] | Mapping[int, str] = SAMPLE_FIELDS
    ) -> tuple[int, ...]:
        """The field ids of ``ids`` this GPU answers (each entry has its own code)."""
        supported, entries = self._probe(
            pynvml.nvmlDeviceGetFieldValues, handle, list(ids), index=index
        )
        if not supported or entries is None:
            return ()
        fields: list[int] = []
        for entry in entries:
            code = int(entry.nvmlReturn)
            if code == pynvml.NVML_SUCCESS:
                fields.append(int(entry.fieldId))
                continue
            error = translate_nvml_error(
                pynvml.NVMLError(code), call="nvmlDeviceGetFieldValues", index=index
            )
            if isinstance(error, GpuTransientError):
                fields.append(int(entry.fieldId))
            elif not isinstance(error, _UNAVAILABLE):
                raise error from pynvml.NVMLError(code)
        return tuple(fields)

    def _supported_sm_clocks(self, handle: Any, index: int) -> tuple[int, ...]:
        """SM clocks valid at the highest memory clock, highest first; () when unknown."""
        memory_mhz = self._optional(pynvml.nvmlDeviceGetSupportedMemoryClocks, handle, index=index)
        if not memory_mhz:
            return ()
        graphics_mhz = self._optional(
            pynvml.nvmlDeviceGetSupportedGraphicsClocks, handle, max(memory_mhz), index=index
        )
        return tuple(sorted({int(mhz) for mhz in graphics_mhz or ()}, reverse=True))

    # ---- sampling -------------------------------------------------------------------

    def sample(self, index: int) -> GpuSample:
        """Read every supported field of GPU ``index`` (unsupported ones are ``None``).

        A read that fails transiently costs only its field; the sample fails (with that
        error) only when every read failed. A lost GPU raises ``GpuLostError``.
        """
        gpu = self._gpu(index)
        caps = gpu.info.capabilities
        handle = gpu.handle
        reads = _Reads(index)
        ts_ns = time.time_ns()
        values: dict[int, int | float] = {}
        if gpu.fields:
            entries = self._read(reads, pynvml.nvmlDeviceGetFieldValues, handle, list(gpu.fields))
            if entries is not None:
                ts_ns = self._collect_fields(reads, entries, values, default_ts_ns=ts_ns)
        power_mw = values.get(FIELD_POWER_INSTANT)
        if gpu.power_from_usage:
            power_mw = self._read(reads, pynvml.nvmlDeviceGetPowerUsage, handle)
        energy_mj = values.get(FIELD_ENERGY)
        if gpu.energy_from_counter:
            energy_mj = self._read(reads, pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        utilization = (
            self._read(reads, pynvml.nvmlDeviceGetUtilizationRates, handle)
            if caps.utilization
            else None
        )
        gpu_temp_c = (
            self._read(reads, pynvml.nvmlDeviceGetTemperatureV, handle, pynvml.NVML_TEMPERATURE_GPU)
            if caps.gpu_temp
            else None
        )
        mem_temp_c = values.get(FIELD_MEMORY_TEMP)
        sample = GpuSample(
            index=index,
            uuid=gpu.info.uuid,
            ts_ns=ts_ns,
            power_mw=_int(power_mw),
            power_avg_mw=_int(values.get(FIELD_POWER_AVERAGE)),
            energy_mj=_int(energy_mj),
            gpu_temp_c=None if gpu_temp_c is None else float(gpu_temp_c),
            mem_temp_c=None if mem_temp_c is None else float(mem_temp_c),
            sm_clock_mhz=_int(
                self._read(reads, pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
                if caps.sm_clock
                else None
            ),
            mem_clock_mhz=_int(
                self._read(reads, pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
                if caps.mem_clock
                else None
            ),
            gpu_util_pct=None if utilization is None else float(utilization.gpu),
            mem_util_pct=None if utilization is None else float(utilization.memory),
            power_limit_mw=_int(
                self._read(reads, pynvml.nvmlDeviceGetPowerManagementLimit, handle)
                if caps.power_limit_read
                else None
            ),
            enforced_power_limit_mw=_int(
                self._read(reads, pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
                if caps.enforced_power_limit
                else None
            ),
            clock_event_reasons=_int(
                self._read(reads, pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
                if caps.clock_event_reasons
                else None
            ),
            locked_sm_clocks_mhz=gpu.locked_sm_clocks_mhz,
        )
        if reads.first is not None and not any(
            getattr(sample, name) is not None for name in _MEASURED
        ):
            error, cause = reads.first
            raise error from cause
        return sample

    def health(self, index: int) -> GpuHealth:
        """The health counters of GPU ``index``: XID events so far, one ``GetFieldValues``.

        A counter the GPU does not report is ``None``; one that fails this time is
        ``None`` this time. A lost GPU raises ``GpuLostError``.
        """
        gpu = self._gpu(index)
        self._drain_xid_events()
        values: dict[int, int | float] = {}
        if gpu.health_fields:
            reads = _Reads(index)
            entries = self._read(
                reads, pynvml.nvmlDeviceGetFieldValues, gpu.handle, list(gpu.health_fields)
            )
            if entries is not None:
                self._collect_fields(reads, entries, values, default_ts_ns=0)
        counters = {name: _int(values.get(field_id)) for field_id, name in HEALTH_FIELDS.items()}
        return GpuHealth(
            index=index,
            uuid=gpu.info.uuid,
            xid_errors=gpu.xid_errors if gpu.xid_events else None,
            last_xid=gpu.last_xid,
            **counters,
        )

    def _drain_xid_events(self) -> None:
        """Count the XID events waiting in the event set (without waiting), per GPU."""
        if self._events is None or self._gpus is None:
            return
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError as exc:
                if int(exc.value) != pynvml.NVML_ERROR_TIMEOUT:
                    error = translate_nvml_error(exc, call="nvmlEventSetWait_v2", index=None)
                    self._log.warning("xid_events_unreadable", error=str(error))
                return
            if not int(data.eventType) & XID_EVENT:
                continue
            index = self._by_handle.get(_address(data.device))
            gpu = self._gpus.get(index) if index is not None else None
            if gpu is not None:
                gpu.xid_errors += 1
                gpu.last_xid = int(data.eventData)
                self._log.error("gpu_xid", gpu=index, uuid=gpu.info.uuid, xid=gpu.last_xid)

    def _read(self, reads: _Reads, fn: Callable[..., T], *args: Any) -> T | None:
        """One read of a sample: its value, or None after a field-level failure."""
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            error = translate_nvml_error(exc, call=fn.__name__, index=reads.index)
            if not isinstance(error, _FIELD_LEVEL):
                raise error from exc
            reads.fail(error, exc)
            self._log.debug("gpu_read_failed", gpu=reads.index, call=fn.__name__, code=error.code)
            return None

    def _collect_fields(
        self, reads: _Reads, entries: Any, values: dict[int, int | float], *, default_ts_ns: int
    ) -> int:
        """Copy successful entries into ``values``; return the driver's timestamp in ns."""
        ts_ns: int | None = None
        for entry in entries:
            code = int(entry.nvmlReturn)
            if code == pynvml.NVML_SUCCESS:
                values[int(entry.fieldId)] = _field_number(entry)
                if ts_ns is None and entry.timestamp > 0:
                    ts_ns = int(entry.timestamp) * 1000  # NVML stamps in us since the epoch
                continue
            cause = pynvml.NVMLError(code)
            error = translate_nvml_error(
                cause, call=f"nvmlDeviceGetFieldValues[{int(entry.fieldId)}]", index=reads.index
            )
            if not isinstance(error, _FIELD_LEVEL):
                raise error from cause
            reads.fail(error, cause)
        return default_ts_ns if ts_ns is None else ts_ns

    def _gpu(self, index: int) -> _Gpu:
        if self._gpus is None:
            msg = f"NVML backend is not open (GPU {index}): call discover() first"
            raise GpuLibraryError(msg, index=index, code=pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self._gpus.get(index)
        if gpu is not None:
            return gpu
        if index in self._lost_at_discovery:
            msg = f"GPU {index} was already lost at discovery. {_LOST_HINT}"
            raise GpuLostError(msg, index=index, code=pynvml.NVML_ERROR_GPU_IS_LOST)
        msg = f"no GPU with index {index}; discovered {sorted(self._gpus)}"
        raise GpuInvalidArgumentError(msg, index=index)

    # ---- writes ---------------------------------------------------------------------

    def check_write_access(self) -> None:
        """Re-set the first GPU's current power limit to itself (an idempotent write).

        Raises ``GpuPermissionError`` with how to fix it when NVML refuses. Where the GPU
        does not support power limits at all, writes cannot be checked: that is logged.
        """
        gpus = self._require_open()
        if not gpus:
            return
        gpu = next(iter(gpus.values()))
        index = gpu.info.index
        try:
            limit_mw = int(_call(pynvml.nvmlDeviceGetPowerManagementLimit, gpu.handle, index=index))
            _call(pynvml.nvmlDeviceSetPowerManagementLimit, gpu.handle, limit_mw, index=index)
        except GpuNotSupportedError as exc:
            self._log.warning("write_access_unverified", gpu=index, error=str(exc))

    def set_power_limit_mw(self, index: int, limit_mw: int) -> None:
        """Set the power management limit of GPU ``index`` (mW, passed through unclamped)."""
        gpu = self._gpu(index)
        # The v1 call on purpose: in nvidia-ml-py 13.615.71 the binding of
        # nvmlDeviceSetPowerManagementLimit_v2 drops the C return code and always returns
        # NVML_SUCCESS, so NO_PERMISSION or an out-of-range limit would pass silently.
        _call(pynvml.nvmlDeviceSetPowerManagementLimit, gpu.handle, int(limit_mw), index=index)

    def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock of GPU ``index`` into [min_mhz, max_mhz]."""
        gpu = self._gpu(index)
        _clock_call(gpu, pynvml.nvmlDeviceSetGpuLockedClocks, int(min_mhz), int(max_mhz))
        gpu.locked_sm_clocks_mhz = (int(min_mhz), int(max_mhz))

    def reset_sm_clocks(self, index: int) -> None:
        """Remove any SM clock lock on GPU ``index``."""
        gpu = self._gpu(index)
        _clock_call(gpu, pynvml.nvmlDeviceResetGpuLockedClocks)
        gpu.locked_sm_clocks_mhz = None

    # ---- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Shut NVML down; idempotent, and a later ``discover()`` opens it again."""
        self._gpus = None
        self._infos = ()
        self._lost_at_discovery.clear()
        self._by_handle.clear()
        events, self._events = self._events, None
        if not self._initialized:
            return
        if events is not None:
            try:
                pynvml.nvmlEventSetFree(events)
            except pynvml.NVMLError as exc:
                self._log.warning("nvml_event_set_not_freed", code=int(exc.value))
        self._initialized = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            # Nothing left to do about it: the process is releasing NVML anyway.
            self._log.warning("nvml_shutdown_failed", error=str(exc), code=int(exc.value))

    def _require_open(self) -> dict[int, _Gpu]:
        if self._gpus is None:
            msg = "NVML backend is not open: call discover() first"
            raise GpuLibraryError(msg, code=pynvml.NVML_ERROR_UNINITIALIZED)
        return self._gpus


def _clock_call(gpu: _Gpu, fn: Callable[..., Any], *args: Any) -> None:
    """A clock write on ``gpu``; on a MIG-enabled GPU a refusal says why and what to do."""
    index = gpu.info.index
    try:
        _call(fn, gpu.handle, *args, index=index)
    except GpuNotSupportedError as exc:
        if not gpu.info.mig_enabled:
            raise
        msg = f"{exc}. {MIG_CLOCK_HINT}"
        raise GpuNotSupportedError(msg, index=index, code=exc.code) from exc


def _mig_profile(name: str | None) -> str | None:
    """The profile in a MIG device's name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb")."""
    if name is None:
        return None
    found = _MIG_PROFILE.search(name.strip())
    return found.group(1) if found else None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _address(handle: Any) -> int | None:
    """The address a device handle points at (event data carries the same pointer)."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def _bus_id(pci: Any) -> str | None:
    if pci is None:
        return None
    bus_id = pci.busId
    return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)


def _capability_items(capabilities: Capabilities) -> list[tuple[str, bool]]:
    return [(f.name, bool(getattr(capabilities, f.name))) for f in dataclasses.fields(capabilities)]
