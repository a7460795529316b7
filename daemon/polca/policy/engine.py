"""Turn (policy, controller level, GPU temperatures) into per-GPU caps: the pure engine.

The node agent, the aggregator and the simulator all call ``decide``; so it knows nothing
of NVML or MQTT, does no I/O, reads no clock and logs nothing. Everything it remembers
between calls (thermal hysteresis latches) goes in and out as ``EngineState``, and why each
cap was chosen comes back in ``GpuTarget.reasons`` for the caller to log or publish.

Composition, per GPU: the row level's caps for the GPU's class (or the fail-safe caps when
the controller's lease is missing or expired) and the caps of every latched thermal guard
are candidates; per dimension (SM clock, power limit) the most restrictive wins; the winner
is clamped into the GPU's supported range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from polca.policy.model import CapSpec, Policy, ThermalGuard

FAIL_SAFE_NO_CONTROLLER = "fail_safe:no_controller"
FAIL_SAFE_LEASE_EXPIRED = "fail_safe:lease_expired"
# Avoids 1979.9999 -> 1979 when a percentage resolves to a whole number of MHz.
_PCT_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class GpuView:
    """What the engine needs to know of one GPU; ``None`` means unknown or unsupported."""

    index: int
    uuid: str
    priority_class: str | None  # runtime assignment; None -> policy.assignment, default_class
    gpu_temp_c: float | None
    mem_temp_c: float | None
    sm_clock_max_mhz: int | None  # hardware max; None -> % clock caps cannot resolve
    sm_clock_min_mhz: int | None  # lowest supported lock value
    power_limit_min_mw: int | None
    power_limit_max_mw: int | None
    power_limit_default_mw: int | None  # None -> % power caps cannot resolve


@dataclass(frozen=True, slots=True)
class ControlInput:
    """The row controller's latest command to this node."""

    level: int  # 0 nominal, i -> policy.levels[i - 1]; clamped into [0, top level]
    lease_expires_ns: int  # the command is void at or after this time
    source: str = "controller"  # free text for reasons, e.g. "row/row1 seq 42"


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the engine remembers between calls."""

    thermal_latched: frozenset[tuple[str, str]] = frozenset()  # (gpu uuid, guard name)


@dataclass(frozen=True, slots=True)
class GpuTarget:
    """The caps one GPU should have now, and why."""

    index: int
    uuid: str
    priority_class: str
    sm_clock_max_mhz: int | None  # None = no clock cap (unlock)
    power_limit_mw: int | None  # None = no power cap (restore default/original)
    reasons: tuple[str, ...]  # every active source, e.g. ("level:T2", "thermal:gpu_hot")
    sm_clock_reason: str | None  # the winning source of the clock cap
    power_limit_reason: str | None  # the winning source of the power cap


@dataclass(frozen=True, slots=True)
class Decision:
    """The engine's answer for one node at one instant."""

    targets: tuple[GpuTarget, ...]
    state: EngineState
    level: int  # level in force; 0 while the fail-safe applies
    fail_safe: bool


def decide(
    gpus: Sequence[GpuView],
    *,
    policy: Policy,
    control: ControlInput | None,
    state: EngineState,
    now_ns: int,
) -> Decision:
    """Decide the caps of every GPU in ``gpus``; pure and deterministic.

    Latches of GPUs absent from ``gpus`` are carried over unchanged (a GPU that drops out
    for a tick comes back still latched); latches of guards the policy no longer has are
    dropped.
    """
    fail_safe_reason: str | None = None
    if control is None:
        fail_safe_reason = FAIL_SAFE_NO_CONTROLLER
    elif control.lease_expires_ns <= now_ns:
        fail_safe_reason = FAIL_SAFE_LEASE_EXPIRED
    level = 0 if control is None or fail_safe_reason else policy.clamp_level(control.level)

    guard_names = {guard.name for guard in policy.thermal_guards}
    present = {gpu.uuid for gpu in gpus}
    latched = {
        key for key in state.thermal_latched if key[1] in guard_names and key[0] not in present
    }
    targets: list[GpuTarget] = []
    for gpu in gpus:
        notes: list[str] = []
        priority_class = _priority_class(gpu, policy, notes)
        sources: list[tuple[str, CapSpec]] = []
        if fail_safe_reason is not None:
            spec = policy.fail_safe.caps.get(priority_class)
            if spec is not None:
                sources.append((fail_safe_reason, spec))
        elif level > 0:
            level_spec = policy.levels[level - 1]
            spec = level_spec.caps.get(priority_class)
            if spec is not None:
                sources.append((f"level:{level_spec.name}", spec))
        for guard in policy.thermal_guards:
            was = (gpu.uuid, guard.name) in state.thermal_latched
            if not guard_latched(guard, gpu, was_latched=was):
                continue
            latched.add((gpu.uuid, guard.name))
            guard_spec = guard.caps_for(priority_class)
            if guard_spec is not None:
                sources.append((f"thermal:{guard.name}", guard_spec))
        targets.append(_target(gpu, priority_class, sources, notes))
    return Decision(
        targets=tuple(targets),
        state=EngineState(thermal_latched=frozenset(latched)),
        level=level,
        fail_safe=fail_safe_reason is not None,
    )


def guard_latched(guard: ThermalGuard, gpu: GpuView, *, was_latched: bool) -> bool:
    """Whether ``guard`` holds ``gpu`` after this reading (hysteresis on temperature).

    It latches when any configured temperature is at or above its trigger. It releases only
    when at least one configured temperature is known and every known one is below its
    release temperature: a missing reading never releases a hot GPU.
    """
    pairs = (
        (gpu.gpu_temp_c, guard.gpu_temp_c, guard.release_gpu_temp_c),
        (gpu.mem_temp_c, guard.mem_temp_c, guard.release_mem_temp_c),
    )
    configured = [(temp_c, trig_c, rel_c) for temp_c, trig_c, rel_c in pairs if trig_c is not None]
    if any(temp_c is not None and temp_c >= trig_c for temp_c, trig_c, _ in configured):
        return True
    if not was_latched:
        return False
    known = [(temp_c, rel_c) for temp_c, _, rel_c in configured if temp_c is not None]
    released = bool(known) and all(rel_c is not None and t < rel_c for t, rel_c in known)
    return not released


def _priority_class(gpu: GpuView, policy: Policy, notes: list[str]) -> str:
    if gpu.priority_class is not None:
        if gpu.priority_class in policy.classes:
            return gpu.priority_class
        notes.append(f"unknown_class:{gpu.priority_class}")
    return policy.static_class(index=gpu.index, uuid=gpu.uuid)


def _target(
    gpu: GpuView, priority_class: str, sources: Sequence[tuple[str, CapSpec]], notes: list[str]
) -> GpuTarget:
    clock_mhz: int | None = None
    clock_reason: str | None = None
    power_mw: int | None = None
    power_reason: str | None = None
    for reason, spec in sources:
        clock = _clock_mhz(spec, gpu, reason, notes)
        # Strictly smaller: on a tie the earlier source (the level, then guards) wins.
        if clock is not None and (clock_mhz is None or clock < clock_mhz):
            clock_mhz, clock_reason = clock, reason
        power = _power_mw(spec, gpu, reason, notes)
        if power is not None and (power_mw is None or power < power_mw):
            power_mw, power_reason = power, reason
    if clock_mhz is not None:
        clock_mhz = _noted(clock_mhz, gpu.sm_clock_min_mhz, gpu.sm_clock_max_mhz, notes, "sm_clock")
    if power_mw is not None:
        power_mw = _noted(
            power_mw, gpu.power_limit_min_mw, gpu.power_limit_max_mw, notes, "power_limit"
        )
    return GpuTarget(
        index=gpu.index,
        uuid=gpu.uuid,
        priority_class=priority_class,
        sm_clock_max_mhz=clock_mhz,
        power_limit_mw=power_mw,
        reasons=tuple(reason for reason, _ in sources) + tuple(notes),
        sm_clock_reason=clock_reason,
        power_limit_reason=power_reason,
    )


def _clock_mhz(spec: CapSpec, gpu: GpuView, reason: str, notes: list[str]) -> int | None:
    if spec.sm_clock_max_mhz is not None:
        return spec.sm_clock_max_mhz
    if spec.sm_clock_max_pct is None:
        return None
    if gpu.sm_clock_max_mhz is None:
        notes.append(f"unresolved:{reason}:sm_clock_max_pct")
        return None
    return math.floor(gpu.sm_clock_max_mhz * spec.sm_clock_max_pct / 100 + _PCT_EPSILON)


def _power_mw(spec: CapSpec, gpu: GpuView, reason: str, notes: list[str]) -> int | None:
    if spec.power_limit_w is not None:
        return math.floor(spec.power_limit_w * 1000 + _PCT_EPSILON)
    if spec.power_limit_pct is None:
        return None
    if gpu.power_limit_default_mw is None:
        notes.append(f"unresolved:{reason}:power_limit_pct")
        return None
    return math.floor(gpu.power_limit_default_mw * spec.power_limit_pct / 100 + _PCT_EPSILON)


def within(value: int, low: int | None, high: int | None) -> int:
    """``value`` clamped into a GPU's supported range ``[low, high]`` (None: unbounded).

    The upper bound wins over the lower one: a cap must never exceed the hardware maximum,
    even when a driver reports a minimum above it. The one clamp of power limits and
    clocks: the engine's targets and the actuator's settings both go through it.
    """
    if low is not None and value < low:
        value = low
    if high is not None and value > high:
        value = high
    return value


def _noted(value: int, low: int | None, high: int | None, notes: list[str], what: str) -> int:
    """``within``, noting a raise to the minimum (a cap the GPU cannot go as low as)."""
    if low is not None and value < low:
        notes.append(f"clamped:{what}_min")
    return within(value, low, high)


def tighter(a: GpuTarget, b: GpuTarget) -> GpuTarget:
    """Per dimension, the more restrictive of two targets of one GPU (None is no cap).

    Used where control ends (a crash, a fail-safe stop): the caps left behind are the
    fail-safe's or the ones in force, whichever is tighter, so nothing gets less capped.
    """
    clock_mhz, clock_reason = _min_cap(
        (a.sm_clock_max_mhz, a.sm_clock_reason), (b.sm_clock_max_mhz, b.sm_clock_reason)
    )
    power_mw, power_reason = _min_cap(
        (a.power_limit_mw, a.power_limit_reason), (b.power_limit_mw, b.power_limit_reason)
    )
    return GpuTarget(
        index=a.index,
        uuid=a.uuid,
        priority_class=a.priority_class,
        sm_clock_max_mhz=clock_mhz,
        power_limit_mw=power_mw,
        reasons=tuple(dict.fromkeys((*a.reasons, *b.reasons))),
        sm_clock_reason=clock_reason,
        power_limit_reason=power_reason,
    )


def _min_cap(
    a: tuple[int | None, str | None], b: tuple[int | None, str | None]
) -> tuple[int | None, str | None]:
    if a[0] is None:
        return b
    if b[0] is None or a[0] <= b[0]:
        return a
    return b
