"""A simulated node of GPUs: the backend of the demo, the tests and capacity studies.

``SimulatedBackend`` implements ``GpuBackend`` with a small physical model per GPU, so
that everything above the seam (sampler, actuator, policy, telemetry) runs unchanged
without hardware:

- utilization comes from a load profile (idle, constant, bursty LLM inference, ramp,
  square wave, or a scripted trace; see ``polca.workload``);
- power = idle + utilization x dynamic power, where the SM clock scales the compute part
  roughly as f x V^2 ~ (f / f_max) ** 2.5 and memory power does not scale with it (the
  curve the row simulator uses too, ``polca.physics.power``; the GPU presets are
  ``polca.physics.presets``);
- the power limit is met by lowering the SM clock to the highest supported clock that fits
  (reason ``SW_POWER_CAP``), a clock lock caps it, and a hot die slows it down
  (``SW_THERMAL_SLOWDOWN``);
- the die temperature follows a first-order model T' = (T_coolant + R P - T) / tau;
- the energy counter integrates power.

The model advances lazily, in sub-steps of at most ``STEP_S``, to the injected clock's time
whenever a GPU is read or written, so it runs no thread and costs nothing between reads.
Given the same seed and the same sequence of clock readings and calls it produces the
same samples. Fault injection (lost GPU, denied writes, stuck sensor, hot coolant, a
foreign tool changing the power limit, an out-of-band limit, the power brake) lets tests
and demos exercise every error path. It must stay free of I/O and threads: it is also
instantiated dozens of times in one process by the fleet demo.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from polca.errors import (
    GpuInvalidArgumentError,
    GpuLibraryError,
    GpuLostError,
    GpuPermissionError,
)
from polca.gpu.backend import (
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN,
    CLOCK_EVENT_HW_THERMAL_SLOWDOWN,
    CLOCK_EVENT_SW_POWER_CAP,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    Capabilities,
    GpuHealth,
    GpuInfo,
    GpuSample,
)
from polca.gpu.clocks import snap_down_to_grid_mhz
from polca.physics import power
from polca.physics.presets import GpuModel, get_model
from polca.seeds import MASK64, mix64
from polca.workload.profiles import ConstantLoad, LoadProfile, load_profile

__all__ = ["SimulatedBackend"]

STEP_S = 0.05  # longest integration sub-step; inference bursts last 250 ms or more
MAX_STEPS = 2000  # a longer gap is integrated in coarser steps instead
IDLE_UTIL = 0.01  # below this a GPU counts as idle (reason GPU_IDLE, lowest clock)
POWER_AVG_TAU_S = 1.0  # NVML's averaged power covers about one second
BRAKE_SM_CLOCK_MHZ = 345  # near-halt clock while the power brake is engaged [U]
# Software thermal slowdown: the clock ceiling drops this much at the threshold and per
# degree above it [U: a proportional governor, steep enough to hold the die near it].
THERMAL_SLOWDOWN_STEP_MHZ = 150.0
THERMAL_SLOWDOWN_MHZ_PER_C = 150.0
POWER_NOISE_FRACTION = 0.002  # sensor noise, one standard deviation
POWER_NOISE_W = 0.5
TEMP_NOISE_C = 0.2
MEM_UTIL_SHARE = 0.7  # memory-controller utilization relative to SM utilization

_STICKABLE = frozenset(f.name for f in fields(GpuSample)) - {"index", "uuid", "ts_ns"}


_PERMISSION_HINT = (
    "writing GPU settings needs root or CAP_SYS_ADMIN: run the agent as root, keep "
    "CAP_SYS_ADMIN in its systemd unit (CapabilityBoundingSet=CAP_SYS_ADMIN), start its "
    "container with --cap-add SYS_ADMIN, or run it observe-only "
    "(agent.observe_only: true, POLCA_AGENT__OBSERVE_ONLY=true) to read without writing"
)


@dataclass(slots=True)
class _Gpu:
    """The mutable state of one simulated GPU."""

    index: int
    uuid: str
    stream: int
    load: LoadProfile
    rng: random.Random
    t_s: float  # simulated time the state is valid at
    coolant_c: float
    gpu_temp_c: float
    energy_mj: float
    power_limit_mw: int
    power_w: float = 0.0
    power_avg_w: float = 0.0
    util: float = 0.0
    sm_clock_mhz: int = 0
    reasons: int = 0
    oob_limit_mw: int | None = None
    locked_sm_clocks_mhz: tuple[int, int] | None = None
    lost: bool = False
    brake: bool = False
    stuck: dict[str, Any] = field(default_factory=dict)  # field name -> frozen value
    # Health counters (``health()``): XIDs and ECC errors only by injection; throttle time
    # integrates while the brake or a thermal slowdown holds the clock.
    xid_errors: int = 0
    last_xid: int | None = None
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    brake_s: float = 0.0
    hw_thermal_s: float = 0.0
    sw_thermal_s: float = 0.0


def _count_throttle(g: _Gpu, reasons: int, step_s: float) -> None:
    """Add a sub-step to the throttle times its clock event reasons name."""
    if reasons & CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN:
        g.brake_s += step_s
    if reasons & CLOCK_EVENT_HW_THERMAL_SLOWDOWN:
        g.hw_thermal_s += step_s
    if reasons & CLOCK_EVENT_SW_THERMAL_SLOWDOWN:
        g.sw_thermal_s += step_s


class SimulatedBackend:
    """A ``GpuBackend`` over ``count`` simulated GPUs of one ``model``.

    Thread-safe: the agent calls it from the ``ThreadedGpu`` worker while a test or the
    demo injects faults from another thread.
    """

    def __init__(
        self,
        *,
        count: int = 8,
        model: str | GpuModel = "H100-SXM",
        load: LoadProfile | str = "inference",
        seed: int = 0,
        coolant_inlet_c: float = 30.0,
        clock: Callable[[], float] | None = None,
        privileged: bool = True,
        time_ns: Callable[[], int] | None = None,
    ) -> None:
        """Set up the GPUs at idle thermal equilibrium; reads nothing, starts nothing.

        ``clock`` gives monotonic seconds (default ``time.monotonic``). Sample timestamps
        come from ``time_ns``; by default ``time.time_ns``, or the simulated clock in ns
        when ``clock`` is injected, so that an injected clock makes runs reproducible.
        """
        if count < 1:
            msg = f"count must be at least 1, got {count}"
            raise ValueError(msg)
        self._model = model if isinstance(model, GpuModel) else get_model(model)
        self._clock = clock or time.monotonic
        if time_ns is not None:
            self._time_ns = time_ns
        elif clock is not None:
            sim_clock = clock
            self._time_ns = lambda: round(sim_clock() * 1e9)
        else:
            self._time_ns = time.time_ns
        self._writes_allowed = privileged
        self._sample_fault: Exception | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._t0_s = self._clock()
        profile = load_profile(load)
        m = self._model
        idle_temp_c = coolant_inlet_c + m.thermal_resistance_c_per_w * m.idle_power_w
        self._gpus: list[_Gpu] = []
        for index in range(count):
            stream = mix64((seed & MASK64) * 1024 + index)
            self._gpus.append(
                _Gpu(
                    index=index,
                    uuid=f"GPU-{uuid.UUID(int=(stream << 64) | mix64(stream))}",
                    stream=stream,
                    load=profile,
                    rng=random.Random(stream),  # noqa: S311 - sensor noise, not security
                    t_s=self._t0_s,
                    coolant_c=coolant_inlet_c,
                    gpu_temp_c=idle_temp_c,
                    # Energy counts since driver load: start somewhere, never at zero.
                    energy_mj=float(1_000_000 + stream % 1_000_000_000),
                    power_limit_mw=m.tdp_mw,
                    power_w=m.idle_power_w,
                    power_avg_w=m.idle_power_w,
                    sm_clock_mhz=m.sm_clock_min_mhz,
                )
            )
        self._supported = frozenset(m.supported_sm_clocks_mhz)
        self._decay_step = math.exp(-STEP_S / m.thermal_time_constant_s)
        self._avg_step = 1.0 - math.exp(-STEP_S / POWER_AVG_TAU_S)

    @property
    def model(self) -> GpuModel:
        """The GPU model every simulated GPU follows."""
        return self._model

    # --- GpuBackend ----------------------------------------------------------------------

    def discover(self) -> Sequence[GpuInfo]:
        """List the GPUs (lost ones too: they were enumerated before they fell off)."""
        m = self._model
        with self._lock:
            self._closed = False
            caps = Capabilities(**{f.name: True for f in fields(Capabilities)})
            return tuple(
                GpuInfo(
                    index=g.index,
                    uuid=g.uuid,
                    name=m.product_name,
                    capabilities=caps,
                    pci_bus_id=f"00000000:{0x18 + 0x10 * g.index:02X}:00.0",
                    power_limit_min_mw=round(m.power_limit_min_w * 1000),
                    power_limit_max_mw=round(m.power_limit_max_w * 1000),
                    power_limit_default_mw=m.tdp_mw,
                    sm_clock_max_mhz=m.sm_clock_max_mhz,
                    mem_clock_max_mhz=m.mem_clock_mhz,
                    supported_sm_clocks_mhz=m.supported_sm_clocks_mhz,
                )
                for g in self._gpus
            )

    def sample(self, index: int) -> GpuSample:
        """Advance GPU ``index`` to now and read it, with seeded sensor noise."""
        with self._lock:
            if self._sample_fault is not None:
                raise self._sample_fault
            g = self._live(index)
            self._advance(g, self._clock())
            return self._read(g)

    def health(self, index: int) -> GpuHealth:
        """The health counters of GPU ``index``: injected XIDs and ECC errors, throttle time."""
        with self._lock:
            g = self._live(index)
            self._advance(g, self._clock())
            return GpuHealth(
                index=g.index,
                uuid=g.uuid,
                xid_errors=g.xid_errors,
                last_xid=g.last_xid,
                ecc_corrected_volatile=g.ecc_corrected,
                ecc_uncorrected_volatile=g.ecc_uncorrected,
                ecc_corrected_aggregate=g.ecc_corrected,
                ecc_uncorrected_aggregate=g.ecc_uncorrected,
                retired_pages_sbe=0,
                retired_pages_dbe=0,
                retired_pages_pending=0,
                remapped_rows_correctable=0,
                remapped_rows_uncorrectable=0,
                row_remap_pending=0,
                row_remap_failure=0,
                pcie_replays=0,
                power_brake_ns=round(g.brake_s * 1e9),
                hw_thermal_slowdown_ns=round(g.hw_thermal_s * 1e9),
                sw_thermal_slowdown_ns=round(g.sw_thermal_s * 1e9),
            )

    def check_write_access(self) -> None:
        """Raise ``GpuPermissionError`` while writes are denied."""
        with self._lock:
            self._check_open()
            self._check_writes(None)

    def set_power_limit_mw(self, index: int, limit_mw: int) -> None:
        """Set the management power limit; outside [min, max] is ``GpuInvalidArgumentError``."""
        with self._lock:
            g = self._live(index)
            self._check_writes(index)
            self._validate_limit(index, limit_mw)
            self._advance(g, self._clock())
            g.power_limit_mw = limit_mw

    def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock range; both ends must be supported clocks, min <= max."""
        with self._lock:
            g = self._live(index)
            self._check_writes(index)
            if min_mhz > max_mhz or not {min_mhz, max_mhz} <= self._supported:
                m = self._model
                msg = (
                    f"GPU {index}: cannot lock SM clocks to [{min_mhz}, {max_mhz}] MHz; "
                    f"supported: {m.sm_clock_min_mhz}..{m.sm_clock_max_mhz} MHz in "
                    f"{m.sm_clock_step_mhz} MHz steps, min <= max"
                )
                raise GpuInvalidArgumentError(msg, index=index)
            self._advance(g, self._clock())
            g.locked_sm_clocks_mhz = (min_mhz, max_mhz)

    def reset_sm_clocks(self, index: int) -> None:
        """Remove the SM clock lock of GPU ``index`` (a no-op when unlocked)."""
        with self._lock:
            g = self._live(index)
            self._check_writes(index)
            self._advance(g, self._clock())
            g.locked_sm_clocks_mhz = None

    def close(self) -> None:
        """Mark the library closed; later calls other than ``discover()`` fail. Idempotent."""
        with self._lock:
            self._closed = True

    # --- load and environment ------------------------------------------------------------

    def set_load(self, index: int, profile: LoadProfile | str) -> None:
        """Give GPU ``index`` its own load profile from now on."""
        new = load_profile(profile)
        with self._lock:
            g = self._gpu(index)
            self._advance(g, self._clock())
            g.load = new

    def set_utilization(self, index: int, util: float) -> None:
        """Hold GPU ``index`` at a constant utilization (0..1) from now on."""
        self.set_load(index, ConstantLoad(util))

    def set_coolant_inlet_c(self, temp_c: float, index: int | None = None) -> None:
        """Change the coolant (or inlet air) temperature of one GPU or of all."""
        with self._lock:
            for g in self._gpus if index is None else [self._gpu(index)]:
                self._advance(g, self._clock())
                g.coolant_c = temp_c

    def held(self, index: int) -> tuple[tuple[int, int] | None, int]:
        """What GPU ``index`` holds now: its clock lock and power limit (mW).

        Works after ``close()`` too, so a test can see what a daemon left behind.
        """
        with self._lock:
            g = self._gpu(index)
            return g.locked_sm_clocks_mhz, g.power_limit_mw

    # --- fault injection -----------------------------------------------------------------

    def lose_gpu(self, index: int) -> None:
        """Make GPU ``index`` raise ``GpuLostError`` on every call, as if off the bus."""
        with self._lock:
            self._gpu(index).lost = True

    def restore_gpu(self, index: int) -> None:
        """Bring a lost GPU back (after a reset its settings are the defaults again)."""
        with self._lock:
            g = self._gpu(index)
            self._advance(g, self._clock())
            if g.lost:
                g.lost = False
                g.power_limit_mw = self._model.tdp_mw
                g.locked_sm_clocks_mhz = None

    def fail_samples(self, exc: Exception | None) -> None:
        """Make every ``sample()`` raise ``exc`` (None: stop), as a binding bug would.

        Unlike the NVML error table's ``GpuError`` subclasses, an arbitrary exception is
        what polca does not expect: it tests the path where a daemon fails, not a GPU.
        """
        with self._lock:
            self._sample_fault = exc

    def deny_writes(self) -> None:
        """Make every write and ``check_write_access()`` raise ``GpuPermissionError``."""
        with self._lock:
            self._writes_allowed = False

    def allow_writes(self) -> None:
        """Undo ``deny_writes()``."""
        with self._lock:
            self._writes_allowed = True

    def stick_sensor(self, index: int, field_name: str) -> None:
        """Freeze the reading ``field_name`` (a ``GpuSample`` field) of GPU ``index``."""
        if field_name not in _STICKABLE:
            msg = f"cannot stick {field_name!r}; choose one of {sorted(_STICKABLE)}"
            raise ValueError(msg)
        with self._lock:
            g = self._gpu(index)
            self._advance(g, self._clock())
            g.stuck[field_name] = getattr(self._read(g), field_name)

    def unstick_sensor(self, index: int, field_name: str | None = None) -> None:
        """Let one frozen reading (or all of GPU ``index``) follow the model again."""
        with self._lock:
            g = self._gpu(index)
            if field_name is None:
                g.stuck.clear()
            else:
                g.stuck.pop(field_name, None)

    def external_set_power_limit_mw(self, index: int, limit_mw: int) -> None:
        """Change the limit as another tool (``nvidia-smi -pl``) would, bypassing polca."""
        with self._lock:
            g = self._gpu(index)
            self._validate_limit(index, limit_mw)
            self._advance(g, self._clock())
            g.power_limit_mw = limit_mw

    def set_oob_limit_mw(self, index: int, limit_mw: int | None) -> None:
        """Apply (or clear with ``None``) an out-of-band limit, e.g. from the BMC."""
        with self._lock:
            g = self._gpu(index)
            self._advance(g, self._clock())
            g.oob_limit_mw = limit_mw

    def set_power_brake(self, index: int, *, engaged: bool) -> None:
        """Engage or release the hardware power brake (a near halt, reason 0x80)."""
        with self._lock:
            g = self._gpu(index)
            self._advance(g, self._clock())
            g.brake = engaged

    def inject_xid(self, index: int, code: int) -> None:
        """Report an XID error of ``code`` on GPU ``index`` (as the driver's event would)."""
        with self._lock:
            g = self._gpu(index)
            g.xid_errors += 1
            g.last_xid = code

    def inject_ecc_errors(self, index: int, *, corrected: int = 0, uncorrected: int = 0) -> None:
        """Count ECC errors on GPU ``index`` (volatile and aggregate alike)."""
        with self._lock:
            g = self._gpu(index)
            g.ecc_corrected += corrected
            g.ecc_uncorrected += uncorrected

    # --- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            msg = "the simulated GPU library is closed; call discover() to open it again"
            raise GpuLibraryError(msg)

    def _gpu(self, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            msg = f"no GPU {index}: this node has GPUs 0..{len(self._gpus) - 1}"
            raise GpuInvalidArgumentError(msg, index=index)
        return self._gpus[index]

    def _live(self, index: int) -> _Gpu:
        self._check_open()
        g = self._gpu(index)
        if g.lost:
            msg = f"GPU {index} ({g.uuid}) is lost (fell off the bus); it needs a reset"
            raise GpuLostError(msg, index=index)
        return g

    def _check_writes(self, index: int | None) -> None:
        if not self._writes_allowed:
            msg = f"permission denied: {_PERMISSION_HINT}"
            raise GpuPermissionError(msg, index=index)

    def _validate_limit(self, index: int, limit_mw: int) -> None:
        m = self._model
        low_mw, high_mw = round(m.power_limit_min_w * 1000), round(m.power_limit_max_w * 1000)
        if not low_mw <= limit_mw <= high_mw:
            msg = f"GPU {index}: power limit {limit_mw} mW outside [{low_mw}, {high_mw}] mW"
            raise GpuInvalidArgumentError(msg, index=index)

    def _advance(self, g: _Gpu, now_s: float) -> None:
        """Integrate GPU ``g`` from its time to ``now_s`` (a clock going back is ignored)."""
        gap_s = now_s - g.t_s
        if gap_s <= 0:
            return
        steps = min(MAX_STEPS, math.ceil(gap_s / STEP_S - 1e-9))
        step_s = gap_s / steps
        t_s = g.t_s
        for _ in range(steps):
            t_s += step_s
            self._step(g, t_s, step_s)
        g.t_s = now_s

    def _step(self, g: _Gpu, t_s: float, step_s: float) -> None:
        """Advance ``g`` by one sub-step ending at ``t_s``, holding power over the step."""
        m = self._model
        util = g.load.utilization(t_s - self._t0_s, g.stream)
        util = 0.0 if util < IDLE_UTIL else min(1.0, util)
        reasons = 0
        ceiling_mhz = m.sm_clock_max_mhz
        if g.locked_sm_clocks_mhz is not None:
            ceiling_mhz = min(ceiling_mhz, g.locked_sm_clocks_mhz[1])
        if g.brake:
            ceiling_mhz = min(ceiling_mhz, BRAKE_SM_CLOCK_MHZ)
            reasons |= CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
        if g.gpu_temp_c >= m.shutdown_temp_c:
            ceiling_mhz = m.sm_clock_min_mhz
            reasons |= CLOCK_EVENT_HW_THERMAL_SLOWDOWN
        elif g.gpu_temp_c >= m.slowdown_temp_c:
            over_c = g.gpu_temp_c - m.slowdown_temp_c
            thermal_mhz = (
                m.sm_clock_max_mhz - THERMAL_SLOWDOWN_STEP_MHZ - THERMAL_SLOWDOWN_MHZ_PER_C * over_c
            )
            snapped_mhz = snap_down_to_grid_mhz(
                thermal_mhz,
                min_mhz=m.sm_clock_min_mhz,
                max_mhz=m.sm_clock_max_mhz,
                step_mhz=m.sm_clock_step_mhz,
            )
            ceiling_mhz = min(ceiling_mhz, snapped_mhz)
            reasons |= CLOCK_EVENT_SW_THERMAL_SLOWDOWN
        if util == 0.0:
            clock_mhz = m.sm_clock_min_mhz
            power_w = m.idle_power_w
            reasons |= CLOCK_EVENT_GPU_IDLE
        else:
            clock_mhz = ceiling_mhz
            power_w = self._power_w(util, clock_mhz)
            limit_mw = g.power_limit_mw
            if g.oob_limit_mw is not None:
                limit_mw = min(limit_mw, g.oob_limit_mw)
            limit_w = limit_mw / 1000.0
            if power_w > limit_w:
                clock_mhz = self._clock_for_power(util, limit_w)
                if clock_mhz < ceiling_mhz:
                    reasons |= CLOCK_EVENT_SW_POWER_CAP
                else:
                    clock_mhz = ceiling_mhz
                power_w = self._power_w(util, clock_mhz)
        # Exact solution of T' = (T_eq - T) / tau for power held over the step.
        decay = (
            self._decay_step if step_s == STEP_S else math.exp(-step_s / m.thermal_time_constant_s)
        )
        eq_c = g.coolant_c + m.thermal_resistance_c_per_w * power_w
        g.gpu_temp_c = eq_c + (g.gpu_temp_c - eq_c) * decay
        avg = self._avg_step if step_s == STEP_S else 1.0 - math.exp(-step_s / POWER_AVG_TAU_S)
        g.power_avg_w += (power_w - g.power_avg_w) * avg
        g.energy_mj += power_w * step_s * 1000.0
        g.power_w = power_w
        g.util = util
        g.sm_clock_mhz = clock_mhz
        g.reasons = reasons
        _count_throttle(g, reasons, step_s)

    def _power_w(self, util: float, clock_mhz: int) -> float:
        """Power at ``util`` and ``clock_mhz``: idle plus the demand above it, clock-scaled."""
        m = self._model
        return power.power_w(
            m.idle_power_w,
            (m.max_demand_power_w - m.idle_power_w) * util,
            clock_frac=clock_mhz / m.sm_clock_max_mhz,
            mem_share=m.mem_power_share,
            clock_power_exponent=m.clock_power_exponent,
        )

    def _clock_for_power(self, util: float, limit_w: float) -> int:
        """The highest supported clock at which ``util`` draws no more than ``limit_w``."""
        m = self._model
        sm_scale = power.sm_scale_for_limit(
            m.idle_power_w,
            (m.max_demand_power_w - m.idle_power_w) * util,
            limit_w=limit_w,
            mem_share=m.mem_power_share,
        )
        if sm_scale <= 0.0:
            return m.sm_clock_min_mhz  # even the lowest clock exceeds the limit
        frac = power.clock_frac_for_sm_scale(sm_scale, clock_power_exponent=m.clock_power_exponent)
        return snap_down_to_grid_mhz(
            frac * m.sm_clock_max_mhz,
            min_mhz=m.sm_clock_min_mhz,
            max_mhz=m.sm_clock_max_mhz,
            step_mhz=m.sm_clock_step_mhz,
        )

    def _read(self, g: _Gpu) -> GpuSample:
        """Turn the state of ``g`` into a sample, as NVML would report it."""
        m = self._model
        gauss = g.rng.gauss
        sigma_w = POWER_NOISE_W + POWER_NOISE_FRACTION * g.power_w
        gpu_temp_c = g.gpu_temp_c + gauss(0.0, TEMP_NOISE_C)
        enforced_mw = g.power_limit_mw
        if g.oob_limit_mw is not None:
            enforced_mw = min(enforced_mw, g.oob_limit_mw)
        sample = GpuSample(
            index=g.index,
            uuid=g.uuid,
            ts_ns=self._time_ns(),
            power_mw=max(0, round((g.power_w + gauss(0.0, sigma_w)) * 1000)),
            power_avg_mw=round(g.power_avg_w * 1000),
            energy_mj=int(g.energy_mj),
            # NVML reports whole degrees.
            gpu_temp_c=float(round(gpu_temp_c)),
            mem_temp_c=float(round(gpu_temp_c + m.mem_temp_offset_c * g.util)),
            sm_clock_mhz=g.sm_clock_mhz,
            mem_clock_mhz=m.mem_clock_mhz,
            gpu_util_pct=float(round(g.util * 100)),
            mem_util_pct=float(round(g.util * MEM_UTIL_SHARE * 100)),
            power_limit_mw=g.power_limit_mw,
            enforced_power_limit_mw=enforced_mw,
            clock_event_reasons=g.reasons,
            locked_sm_clocks_mhz=g.locked_sm_clocks_mhz,
        )
        return replace(sample, **g.stuck) if g.stuck else sample
