"""Build and drive the fake ``libnvidia-ml.so.1`` that tests polca's NVML backend without a GPU.

The fake (``fake_nvml.c``) is loaded by the real, unmodified pynvml binding, so the tests
exercise the actual C symbol names, struct layouts and error codes. Its state is a small
``key value`` text file that the library re-reads whenever it changes and writes back after
a successful set call; ``FakeNvml`` reads and edits that file under the same ``flock`` the
library uses, and bumps the same generation counter (``<state>.gen``) that the library
checks on every call, so a test can drive a fake GPU while the agent runs in another process.

Two ways in:

- another process: ``subprocess.run(..., env=fake.env())`` (``LD_LIBRARY_PATH`` + state path);
- this process: ``fake.load_in_process()`` puts the library into ``pynvml.nvmlLib`` (pynvml
  loads its library once per process) and points it at this fake's state file, so many tests
  share one loaded library and each swaps in its own state.

This module is test tooling: it never imports polca.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import struct
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

SOURCE_PATH = Path(__file__).with_name("fake_nvml.c")
LIB_NAME = "libnvidia-ml.so.1"
DEFAULT_BUILD_ROOT = Path(__file__).resolve().parents[2] / "build" / "fake_nvml"

# NVML return codes the tests inject most often.
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

FakeValue: TypeAlias = int | str | list[int] | None

_STRING_KEYS = frozenset({"name", "uuid", "pci_bus_id"})
_LIST_KEYS = frozenset({"supported_mem_clocks", "supported_sm_clocks"})
_INT_KEYS = frozenset(
    {
        "error",
        "power_mw",
        "power_avg_mw",
        "energy_mj",
        "gpu_temp_c",
        "mem_temp_c",
        "sm_clock_mhz",
        "mem_clock_mhz",
        "max_sm_clock_mhz",
        "max_mem_clock_mhz",
        "util_gpu_pct",
        "util_mem_pct",
        "power_limit_mw",
        "power_limit_min_mw",
        "power_limit_max_mw",
        "power_limit_default_mw",
        "external_limit_mw",
        "locked_min_mhz",
        "locked_max_mhz",
        "clock_event_reasons",
        "pci_device_id",
        "ecc_sbe_vol",
        "ecc_dbe_vol",
        "ecc_sbe_agg",
        "ecc_dbe_agg",
        "retired_sbe",
        "retired_dbe",
        "retired_pending",
        "pcie_replay",
        "remapped_cor",
        "remapped_unc",
        "remapped_pending",
        "remapped_failure",
        "sw_thermal_ns",
        "hw_thermal_ns",
        "power_brake_ns",
        "xid_count",
        "xid_code",
        "mig_mode",
        "mig_pending",
        "max_mig_devices",
        "memory_total_mib",
        "app_sm_clock_mhz",
        "app_mem_clock_mhz",
    }
)
GPU_KEYS = _STRING_KEYS | _LIST_KEYS | _INT_KEYS
GLOBAL_KEYS = frozenset({"count", "privileged", "driver_version", "write_delay_ms"})
MAX_MIG_SLOTS = 8
"""MIG device slots per fake GPU (the library's ``MAX_MIG``)."""


@dataclass(frozen=True, slots=True)
class FakeMig:
    """One MIG device of a fake GPU: its UUID, profile and instance ids (a compute instance)."""

    uuid: str
    profile: str  # e.g. "1g.10gb"; the MIG device's NVML name is "<GPU name> MIG <profile>"
    gpu_instance_id: int
    compute_instance_id: int
    memory_mib: int


def mig_uuid(gpu: int, slot: int) -> str:
    """A MIG device UUID in NVML's form (``MIG-`` and a UUID), distinct per GPU and slot."""
    return f"MIG-fa4e{gpu:04x}-0000-4000-9000-{slot:012x}"


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Static figures of one fake GPU model (limits in mW, clocks in MHz)."""

    name: str
    power_limit_min_mw: int
    power_limit_max_mw: int
    max_sm_clock_mhz: int
    min_sm_clock_mhz: int
    mem_clock_mhz: int
    pci_device_id: int


MODELS: dict[str, GpuModel] = {
    model.name: model
    for model in (
        GpuModel("NVIDIA H100 80GB HBM3", 200_000, 700_000, 1980, 345, 2619, 0x233010DE),
        GpuModel("NVIDIA H200", 200_000, 700_000, 1980, 345, 3201, 0x233510DE),
        GpuModel("NVIDIA A100-SXM4-80GB", 100_000, 400_000, 1410, 210, 1593, 0x20B210DE),
    )
}


def build_fake_nvml(build_root: Path | None = None) -> Path:
    """Compile ``fake_nvml.c`` with the system gcc, once per source version; return the .so.

    The library lands in ``<build_root>/<source hash>/libnvidia-ml.so.1``, so a second call
    (or a second test session) reuses it.
    """
    source = SOURCE_PATH.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    out_dir = (build_root or DEFAULT_BUILD_ROOT) / digest
    lib_path = out_dir / LIB_NAME
    if lib_path.exists():
        return lib_path
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_path = out_dir / f"{LIB_NAME}.{os.getpid()}.tmp"
    argv = ["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
    argv += ["-o", str(tmp_path), str(SOURCE_PATH), "-lpthread"]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        msg = f"building the fake NVML library failed:\n{result.stderr}"
        raise RuntimeError(msg)
    tmp_path.replace(lib_path)
    return lib_path


def _format(value: FakeValue | bool) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list | tuple):
        return " ".join(str(int(v)) for v in value)
    text = str(value)
    if "\n" in text:
        msg = f"fake NVML values are single lines: {text!r}"
        raise ValueError(msg)
    return text


def _parse(key: str, raw: str) -> FakeValue:
    leaf = key.rsplit(".", 1)[-1]
    if leaf in _STRING_KEYS or key == "driver_version":
        return raw
    if leaf in _LIST_KEYS:
        return [int(v) for v in raw.split()]
    if raw == "none":
        return None
    return int(raw, 0)


class FakeNvml:
    """One fake node: a state file for ``libnvidia-ml.so.1`` plus helpers to drive it.

    ``FakeNvml(tmp_path, gpus=8, model="NVIDIA H100 80GB HBM3")`` writes a full state for
    ``gpus`` GPUs of ``model``. Values use NVML's units: mW, mJ, °C, MHz, percent.
    """

    def __init__(
        self,
        directory: Path,
        *,
        gpus: int = 8,
        model: str = "NVIDIA H100 80GB HBM3",
        privileged: bool = True,
        driver_version: str = "560.35.03",
        lib_path: Path | None = None,
    ) -> None:
        self.lib_path = lib_path if lib_path is not None else build_fake_nvml()
        self.lib_dir = self.lib_path.parent
        self.state_path = directory / "fake_nvml_state.txt"
        self._lock_path = directory / "fake_nvml_state.txt.lock"
        self._generation_path = directory / "fake_nvml_state.txt.gen"
        self._lib: ctypes.CDLL | None = None
        preset = MODELS[model]
        lines = {
            "count": str(gpus),
            "privileged": _format(privileged),
            "driver_version": driver_version,
        }
        for index in range(gpus):
            for key, value in self._gpu_defaults(index, preset).items():
                lines[f"gpu.{index}.{key}"] = _format(value)
        with self._locked():
            self._write(lines)

    @staticmethod
    def _gpu_defaults(index: int, preset: GpuModel) -> dict[str, FakeValue]:
        limit_max_mw = preset.power_limit_max_mw
        return {
            "name": preset.name,
            "uuid": f"GPU-fa4e{index:04x}-0000-4000-8000-{index:012x}",
            "pci_bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0",
            "error": 0,
            "power_mw": limit_max_mw // 2,
            "power_avg_mw": limit_max_mw // 2 - 5_000,
            "energy_mj": 1_000_000_000 + 1_000 * index,
            "gpu_temp_c": 55,
            "mem_temp_c": 62,
            "sm_clock_mhz": preset.max_sm_clock_mhz,
            "mem_clock_mhz": preset.mem_clock_mhz,
            "max_sm_clock_mhz": preset.max_sm_clock_mhz,
            "max_mem_clock_mhz": preset.mem_clock_mhz,
            "util_gpu_pct": 90,
            "util_mem_pct": 40,
            "power_limit_mw": limit_max_mw,
            "power_limit_min_mw": preset.power_limit_min_mw,
            "power_limit_max_mw": limit_max_mw,
            "power_limit_default_mw": limit_max_mw,
            "external_limit_mw": limit_max_mw,
            "locked_min_mhz": 0,
            "locked_max_mhz": 0,
            "clock_event_reasons": 0,
            "pci_device_id": preset.pci_device_id,
            "mig_mode": 0,  # MIG-capable, off (set_mig turns it on)
            "mig_pending": 0,
            "max_mig_devices": 7,
            "supported_mem_clocks": [preset.mem_clock_mhz],
            "supported_sm_clocks": list(
                range(preset.max_sm_clock_mhz, preset.min_sm_clock_mhz - 1, -15)
            ),
        }

    # ---- the state file -------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, str]:
        lines: dict[str, str] = {}
        for line in self.state_path.read_text().splitlines():
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            key, _, raw = stripped.partition(" ")
            lines[key] = raw.strip()
        return lines

    def _write(self, lines: Mapping[str, str]) -> None:
        # A new inode per version and a strictly later mtime, so the library always notices.
        previous_ns = self.state_path.stat().st_mtime_ns if self.state_path.exists() else 0
        tmp_path = self.state_path.with_name(f"{self.state_path.name}.tmp.py{os.getpid()}")
        body = "".join(f"{key} {raw}\n" for key, raw in lines.items())
        tmp_path.write_text(f"# fake libnvidia-ml.so.1 state\n{body}")
        mtime_ns = max(time.time_ns(), previous_ns + 1_000)
        os.utime(tmp_path, ns=(mtime_ns, mtime_ns))
        tmp_path.replace(self.state_path)
        self._bump_generation()

    def _bump_generation(self) -> None:
        # The library maps this counter and re-reads the state when it changes.
        fd = os.open(self._generation_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            raw = os.pread(fd, 8, 0)
            value = struct.unpack("=Q", raw)[0] if len(raw) == 8 else 0
            os.pwrite(fd, struct.pack("=Q", value + 1), 0)
        finally:
            os.close(fd)

    def _update(self, changes: Mapping[str, str | None]) -> None:
        with self._locked():
            lines = self._read()
            for key, raw in changes.items():
                if raw is None:
                    lines.pop(key, None)
                else:
                    lines[key] = raw
            self._write(lines)

    # ---- public API -------------------------------------------------------------------

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess that should load this fake instead of NVML."""
        env = dict(os.environ if base is None else base)
        previous = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{self.lib_dir}:{previous}" if previous else str(self.lib_dir)
        env["FAKE_NVML_STATE"] = str(self.state_path)
        return env

    def set(self, gpu: int | None = None, /, **fields: FakeValue | bool) -> None:
        """Set node keys (``gpu=None``: count, privileged, driver_version) or GPU keys.

        ``None`` makes a numeric field unsupported (its read returns NOT_SUPPORTED).
        """
        allowed = GLOBAL_KEYS if gpu is None else GPU_KEYS
        unknown = sorted(set(fields) - allowed)
        if unknown:
            msg = f"unknown fake NVML keys {unknown}; known: {sorted(allowed)}"
            raise KeyError(msg)
        prefix = "" if gpu is None else f"gpu.{gpu}."
        self._update({f"{prefix}{key}": _format(value) for key, value in fields.items()})

    def get(self, gpu: int | None = None) -> dict[str, FakeValue]:
        """Current state of one GPU (or the node keys), as the library last wrote it.

        A GPU's dict also holds ``enforced_limit_mw``, derived the way the library does.
        """
        lines = self._read()
        if gpu is None:
            return {key: _parse(key, raw) for key, raw in lines.items() if "." not in key}
        prefix = f"gpu.{gpu}."
        state = {
            key.removeprefix(prefix): _parse(key, raw)
            for key, raw in lines.items()
            if key.startswith(prefix) and key.removeprefix(prefix) in GPU_KEYS
        }
        limits = [state.get("power_limit_mw"), state.get("external_limit_mw")]
        known = [v for v in limits if isinstance(v, int)]
        state["enforced_limit_mw"] = min(known) if known else None
        return state

    def set_mig(
        self,
        gpu: int,
        devices: Sequence[FakeMig | None] | None = None,
        /,
        *,
        enabled: bool = True,
        pending: bool | None = None,
        max_devices: int = 7,
    ) -> None:
        """Put ``gpu`` in or out of MIG mode with ``devices`` in MIG device slots 0, 1, ...

        A ``None`` device leaves its slot empty (NVML numbers MIG devices with gaps).
        ``pending`` is the mode after the next GPU reset (default: the current one). Slots
        not given are emptied. Use ``set(gpu, mig_mode=None)`` for a GPU without MIG.
        """
        given = list(devices or ())
        if len(given) > MAX_MIG_SLOTS:
            msg = f"a fake GPU has {MAX_MIG_SLOTS} MIG slots, got {len(given)} devices"
            raise ValueError(msg)
        changes: dict[str, str | None] = {
            f"gpu.{gpu}.mig_mode": _format(enabled),
            f"gpu.{gpu}.mig_pending": _format(enabled if pending is None else pending),
            f"gpu.{gpu}.max_mig_devices": str(max_devices),
        }
        for slot in range(MAX_MIG_SLOTS):
            prefix = f"gpu.{gpu}.mig.{slot}."
            device = given[slot] if slot < len(given) else None
            changes[f"{prefix}uuid"] = None if device is None else _format(device.uuid)
            changes[f"{prefix}profile"] = None if device is None else _format(device.profile)
            changes[f"{prefix}gi"] = None if device is None else str(device.gpu_instance_id)
            changes[f"{prefix}ci"] = None if device is None else str(device.compute_instance_id)
            changes[f"{prefix}memory_mib"] = None if device is None else str(device.memory_mib)
        self._update(changes)

    def mig_devices(self, gpu: int) -> dict[int, FakeMig]:
        """The MIG devices of ``gpu`` in the state file, by slot (MIG device index)."""
        lines = self._read()
        out: dict[int, FakeMig] = {}
        for slot in range(MAX_MIG_SLOTS):
            prefix = f"gpu.{gpu}.mig.{slot}."
            uuid = lines.get(f"{prefix}uuid")
            if not uuid or uuid == "none":
                continue
            out[slot] = FakeMig(
                uuid=uuid,
                profile=lines.get(f"{prefix}profile", ""),
                gpu_instance_id=int(lines.get(f"{prefix}gi", "0"), 0),
                compute_instance_id=int(lines.get(f"{prefix}ci", "0"), 0),
                memory_mib=int(lines.get(f"{prefix}memory_mib", "0"), 0),
            )
        return out

    def xid(self, gpu: int, code: int) -> None:
        """One XID event of ``code`` on GPU ``gpu``, for every event set it is registered in."""
        with self._locked():
            lines = self._read()
            key = f"gpu.{gpu}.xid_count"
            lines[key] = str(int(lines.get(key, "0"), 0) + 1)
            lines[f"gpu.{gpu}.xid_code"] = str(code)
            self._write(lines)

    def inject(self, function: str, code: int, *, gpu: int | None = None) -> None:
        """Make ``function`` return ``code`` (on one GPU, or everywhere); 0 clears it."""
        key = f"fail.{function}" if gpu is None else f"gpu.{gpu}.fail.{function}"
        self._update({key: str(code) if code else None})

    def fail_field(self, gpu: int, field_id: int, code: int) -> None:
        """Make one GetFieldValues entry of ``gpu`` carry ``code``; 0 clears it."""
        self._update({f"gpu.{gpu}.field_fail.{field_id}": str(code) if code else None})

    def lose(self, gpu: int, code: int = NVML_ERROR_GPU_IS_LOST) -> None:
        """Make every call on ``gpu`` fail with ``code`` (GPU_IS_LOST by default)."""
        self.set(gpu, error=code)

    def load_in_process(self) -> ctypes.CDLL:
        """Load the fake into this process's pynvml (once) and point it at this state."""
        import pynvml

        loaded = pynvml.nvmlLib
        if loaded is None:
            lib = ctypes.CDLL(str(self.lib_path))
            pynvml.nvmlLib = lib
        elif isinstance(loaded, ctypes.CDLL) and hasattr(loaded, "fakeNvmlSetStatePath"):
            lib = loaded
        else:
            msg = "a real NVML library is already loaded in this process"
            raise RuntimeError(msg)
        lib.fakeNvmlCallCount.restype = ctypes.c_ulonglong
        lib.fakeNvmlCallCount.argtypes = [ctypes.c_char_p]
        lib.fakeNvmlSetStatePath.argtypes = [ctypes.c_char_p]
        lib.fakeNvmlSetStatePath(str(self.state_path).encode())
        self._lib = lib
        return lib

    def unload_in_process(self) -> None:
        """Detach the in-process library from this state: NVML init then fails (no driver)."""
        if self._lib is not None:
            self._lib.fakeNvmlSetStatePath(b"")
            self._lib = None

    def call_count(self, function: str | None = None) -> int:
        """How often the in-process library ran ``function`` (all functions: ``None``)."""
        lib = self._require_lib()
        name = None if function is None else function.encode()
        return int(lib.fakeNvmlCallCount(name))

    def reset_call_counts(self) -> None:
        """Zero the in-process library's call counters."""
        self._require_lib().fakeNvmlResetCallCounts()

    def init_count(self) -> int:
        """The in-process library's nvmlInit reference count."""
        return int(self._require_lib().fakeNvmlInitCount())

    def _require_lib(self) -> ctypes.CDLL:
        if self._lib is None:
            msg = "call load_in_process() first"
            raise RuntimeError(msg)
        return self._lib


def supported_clocks(model: str) -> Sequence[int]:
    """The SM clock list a fake GPU of ``model`` reports, highest first."""
    preset = MODELS[model]
    return list(range(preset.max_sm_clock_mhz, preset.min_sm_clock_mhz - 1, -15))
