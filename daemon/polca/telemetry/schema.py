"""The versioned MQTT wire schema, shared by the agent, the aggregator and the tools.

Every payload is a JSON object with ``schema_version`` (an unknown version is rejected,
loudly), a ``kind`` discriminator and ``ts_ns`` (Unix time in nanoseconds). Values carry
their unit in the key (``power_w``, ``temp_c``, ``sm_clock_mhz``). Received payloads are
validated strictly (unknown keys rejected, bounded sizes); ``decode()`` turns every
problem into one ``SchemaError`` so a malformed message can be counted and dropped.
``docs/mqtt.md`` embeds the JSON Schema of every payload, generated from these models.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

SCHEMA_VERSION = 1
MAX_PAYLOAD_BYTES = 256 * 1024

_Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
_Watts = Annotated[float, Field(ge=0, le=1e7)]
_Temp = Annotated[float, Field(ge=-60, le=300)]
_Mhz = Annotated[int, Field(ge=0, le=100_000)]


class SchemaError(ValueError):
    """A payload that is not valid JSON, too large, of an unknown version or shape."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    ts_ns: int = Field(ge=0, description="Unix time of the message in nanoseconds.")


class GpuTelemetry(BaseModel):
    """One GPU over one publish interval (min/mean/max over the samples taken)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=1023)
    uuid: _Name
    name: str = Field(max_length=128)
    priority_class: _Name | None = None
    state: Literal["ok", "lost", "error"] = "ok"
    samples: int = Field(0, ge=0, description="Samples aggregated into this message.")
    power_w: _Watts | None = Field(None, description="Last instantaneous power.")
    power_min_w: _Watts | None = None
    power_mean_w: _Watts | None = None
    power_max_w: _Watts | None = None
    power_avg_w: _Watts | None = Field(None, description="Driver-averaged power (about 1 s).")
    energy_j: float | None = Field(None, ge=0, description="Energy counter since driver load.")
    energy_delta_j: float | None = Field(None, ge=0, description="Energy over the interval.")
    gpu_temp_c: _Temp | None = None
    gpu_temp_max_c: _Temp | None = None
    mem_temp_c: _Temp | None = None
    sm_clock_mhz: _Mhz | None = None
    mem_clock_mhz: _Mhz | None = None
    gpu_util_pct: float | None = Field(None, ge=0, le=100)
    mem_util_pct: float | None = Field(None, ge=0, le=100)
    power_limit_w: _Watts | None = None
    enforced_power_limit_w: _Watts | None = None
    clock_event_reasons: int | None = Field(None, ge=0, description="NVML bitmask, OR-ed.")
    clock_events: tuple[str, ...] = Field((), description="Names of the bits set.")
    locked_sm_clock_max_mhz: _Mhz | None = None


class AgentHealth(BaseModel):
    """The agent's own health counters, published with telemetry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ticks: int = Field(0, ge=0)
    tick_p99_ms: float | None = Field(None, ge=0)
    gpu_call_p99_ms: float | None = Field(None, ge=0)
    outbox_dropped: int = Field(0, ge=0)
    inbox_dropped: int = Field(0, ge=0)
    control_rejected: int = Field(0, ge=0)
    reconnects: int = Field(0, ge=0)


class Telemetry(_Wire):
    """``.../<node>/telemetry``: one message per node per publish interval, QoS 0."""

    kind: Literal["telemetry"] = "telemetry"
    seq: int = Field(ge=0)
    node: _Name
    interval_s: float = Field(gt=0, le=3600)
    node_gpu_power_w: _Watts = Field(description="Sum of the GPUs' mean power.")
    node_energy_delta_j: float = Field(ge=0)
    level: int = Field(0, ge=0, le=64, description="Control level in force.")
    fail_safe: bool = False
    gpus: tuple[GpuTelemetry, ...] = Field(max_length=1024)
    health: AgentHealth = Field(default_factory=AgentHealth)


class Status(_Wire):
    """``.../<node>/status``: retained, QoS 1; the Last Will says ``offline``."""

    kind: Literal["status"] = "status"
    state: Literal["online", "offline"]
    node: _Name
    agent_version: str = Field("", max_length=64)
    backend: str = Field("", max_length=32)
    gpu_count: int = Field(0, ge=0, le=1024)
    observe_only: bool = False
    policy_name: str | None = Field(None, max_length=128)
    policy_revision: str | None = Field(None, max_length=64)
    started_ns: int | None = Field(None, ge=0)
    reason: str | None = Field(None, max_length=256, description="Why offline, when known.")


class GpuCaps(BaseModel):
    """The caps in force on one GPU and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=1023)
    uuid: _Name
    priority_class: _Name
    sm_clock_max_mhz: _Mhz | None
    power_limit_w: _Watts | None
    reasons: tuple[str, ...] = ()
    applied: bool = True
    error: str | None = Field(None, max_length=512)


class State(_Wire):
    """``.../<node>/state``: retained, QoS 1: the caps in force on every GPU and why."""

    kind: Literal["state"] = "state"
    seq: int = Field(ge=0)
    node: _Name
    level: int = Field(ge=0, le=64)
    fail_safe: bool
    observe_only: bool = False
    lease_expires_ns: int | None = Field(None, ge=0)
    control_seq: int | None = Field(None, ge=0)
    policy_revision: str | None = Field(None, max_length=64)
    gpus: tuple[GpuCaps, ...] = Field(max_length=1024)


class Event(_Wire):
    """``.../<node>/events``: QoS 1, one per notable change (cap applied, GPU lost, ...)."""

    kind: Literal["event"] = "event"
    seq: int = Field(ge=0)
    node: _Name
    event: _Name
    gpu: int | None = Field(None, ge=0, le=1023)
    uuid: _Name | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class Control(_Wire):
    """``{root}/{site}/{row}[/{rack}]/control``: retained, QoS 1, from the row controller.

    Ordering: a message is newer when ``(epoch_ns, seq)`` is greater than the last one
    accepted for the same scope; ``epoch_ns`` is the issuer's start time, so a restarted
    controller supersedes its predecessor. The lease ends at ``lease_expires_ns``, and no
    later than ``lease_expires_ns - issued_ns`` after receipt (guards against clock skew).
    """

    kind: Literal["control"] = "control"
    scope: Literal["row", "rack"]
    row: _Name
    rack: _Name | None = None
    issuer: _Name
    epoch_ns: int = Field(ge=0)
    seq: int = Field(ge=0)
    level: int = Field(ge=0, le=64)
    level_name: str = Field("", max_length=64)
    issued_ns: int = Field(ge=0)
    lease_expires_ns: int = Field(ge=0)
    policy_revision: str | None = Field(None, max_length=64)
    observe: bool = Field(False, description="Shadow mode: agents log but do not apply.")
    reason: str = Field("", max_length=512)


class Assignment(_Wire):
    """``.../<node>/assign``: retained priority classes from a scheduler.

    Keys are GPU UUIDs or indices (as strings); values are class names of the policy.
    """

    kind: Literal["assignment"] = "assignment"
    seq: int = Field(0, ge=0)
    classes: dict[str, _Name] = Field(max_length=1024)


class Meter(_Wire):
    """``{root}/{site}/{row}/meter`` (or a configured topic): row power from a PDU or meter."""

    kind: Literal["meter"] = "meter"
    power_w: _Watts
    energy_j: float | None = Field(None, ge=0, description="Meter energy counter, if any.")


class PolicyBundle(_Wire):
    """``{root}/{site}/{row}/policy``: retained, QoS 1: the node policy, from the aggregator.

    ``text`` is the policy YAML exactly as validated by the aggregator; agents validate it
    again, apply it, and keep it as their last good copy. ``revision`` is the first 12 hex
    digits of the SHA-256 of ``text``.
    """

    kind: Literal["policy"] = "policy"
    name: str = Field(max_length=128)
    revision: str = Field(pattern=r"^[0-9a-f]{12}$")
    text: str = Field(max_length=MAX_PAYLOAD_BYTES // 2)
    source: str = Field("", max_length=512, description="Where the aggregator read it.")


class RackSummary(BaseModel):
    """One rack inside a row summary."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rack: _Name
    power_w: _Watts
    budget_w: _Watts | None = Field(None, description="Effective: electrical or thermal.")
    thermal_budget_w: _Watts | None = Field(None, description="From its cooling loop.")
    level: int = Field(0, ge=0, le=64, description="Rack-scope level, when it has one.")
    nodes_online: int = Field(ge=0)
    nodes_stale: int = Field(ge=0)
    nodes_offline: int = Field(ge=0)


class RowSummary(_Wire):
    """``{root}/{site}/{row}/summary``: retained: the row as the aggregator sees it."""

    kind: Literal["row_summary"] = "row_summary"
    row: _Name
    issuer: _Name
    power_w: _Watts
    power_source: Literal["computed", "meter"]
    budget_w: _Watts
    effective_budget_w: _Watts
    level: int = Field(ge=0, le=64)
    level_name: str = Field("", max_length=64)
    thresholds_w: tuple[float, ...] = ()
    trend_w_per_s: float | None = None
    lease_expires_ns: int | None = Field(None, ge=0)
    observe: bool = False
    racks: tuple[RackSummary, ...] = Field((), max_length=1024)
    offline_nodes: tuple[_Name, ...] = Field((), max_length=4096)
    stale_nodes: tuple[_Name, ...] = Field((), max_length=4096)


class CoolantConnector(BaseModel):
    """One side of a CDU (Redfish ``CoolantConnector``): supply, return, flow, pressure.

    ``secondary`` is the technology cooling system loop to the racks, ``primary`` the
    facility water. Every reading is optional: a CDU reports what it measures.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    supply_temp_c: _Temp | None = Field(None, description="Redfish SupplyTemperatureCelsius.")
    return_temp_c: _Temp | None = Field(None, description="Redfish ReturnTemperatureCelsius.")
    flow_lpm: float | None = Field(
        None, ge=0, le=100_000, description="Redfish FlowLitersPerMinute."
    )
    delta_pressure_kpa: float | None = Field(
        None, ge=-1000, le=10_000, description="Redfish DeltaPressurekPa."
    )
    heat_removed_kw: float | None = Field(
        None, ge=-100_000, le=100_000, description="Redfish HeatRemovedkW."
    )


class Pump(BaseModel):
    """One CDU pump (Redfish ``Pump``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: _Name
    state: Literal["running", "standby", "failed", "off"]
    speed_pct: float | None = Field(None, ge=0, le=100, description="Redfish PumpSpeedPercent.")


class LeakDetector(BaseModel):
    """One leak detector (Redfish ``LeakDetector``; ``DetectorState`` OK/Warning/Critical)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: _Name
    state: Literal["ok", "warning", "critical"]


class CduTelemetry(_Wire):
    """``{root}/{site}/cooling/{cdu}/telemetry``: one CDU reading (Redfish ``CoolingUnit``).

    Published by the CDU itself, by polca's Modbus poller, or by the simulated plant, at a
    steady rate (default 1 s); QoS 0. ``loop`` names the cooling loop the CDU serves.
    """

    kind: Literal["cdu"] = "cdu"
    cdu: _Name
    loop: _Name
    secondary: CoolantConnector
    primary: CoolantConnector | None = None
    pumps: tuple[Pump, ...] = Field((), max_length=16)
    leak_detectors: tuple[LeakDetector, ...] = Field((), max_length=64)
    valve_position_pct: float | None = Field(None, ge=0, le=100)
    status: Literal["ok", "warning", "critical"] = Field(
        "ok", description="The CDU's own health summary (Redfish Status.Health)."
    )


class LoopAlarm(BaseModel):
    """One active alarm of a cooling loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alarm: _Name
    severity: Literal["warning", "degraded", "critical"]


class CoolingLoopState(_Wire):
    """``{root}/{site}/cooling/loop/{loop}/state``: retained: a loop as the aggregator sees it."""

    kind: Literal["cooling_loop"] = "cooling_loop"
    loop: _Name
    cdu: _Name
    racks: tuple[_Name, ...] = Field(max_length=1024)
    heat_load_kw: float | None = None
    heat_removed_kw: float | None = None
    capacity_kw: float | None = None
    headroom_kw: float | None = None
    supply_temp_c: float | None = None
    return_temp_c: float | None = None
    flow_lpm: float | None = None
    flow_fraction: float | None = None
    thermal_budget_w: float | None = None
    severity: Literal["ok", "warning", "degraded", "critical"] = "ok"
    alarms: tuple[LoopAlarm, ...] = Field((), max_length=64)
    emergency: bool = False
    stale: bool = False
    forced_levels: dict[str, int] = Field(default_factory=dict, max_length=1024)


class CoolingAlarm(_Wire):
    """``{root}/{site}/cooling/loop/{loop}/alarms``: QoS 1: one alarm raised or cleared."""

    kind: Literal["cooling_alarm"] = "cooling_alarm"
    loop: _Name
    alarm: _Name
    severity: Literal["warning", "degraded", "critical"]
    action: Literal["raised", "escalated", "deescalated", "cleared"]
    previous: Literal["warning", "degraded", "critical"] | None = None
    value: float | None = None
    threshold: float | None = None
    text: str = Field("", max_length=512)


Message = (
    Telemetry
    | Status
    | State
    | Event
    | Control
    | Assignment
    | Meter
    | PolicyBundle
    | RowSummary
    | CduTelemetry
    | CoolingLoopState
    | CoolingAlarm
)
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Annotated[Message, Field(discriminator="kind")])


def encode(message: BaseModel) -> bytes:
    """Serialise a wire model to compact JSON bytes."""
    return message.model_dump_json(exclude_none=False).encode()


def decode(payload: bytes, expected: type[Message] | None = None) -> Message:
    """Parse and validate a payload; raise ``SchemaError`` describing what is wrong."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        msg = f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}"
        raise SchemaError(msg)
    try:
        raw = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        msg = f"not JSON: {exc}"
        raise SchemaError(msg) from exc
    if not isinstance(raw, dict):
        msg = f"expected a JSON object, got {type(raw).__name__}"
        raise SchemaError(msg)
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        msg = f"unsupported schema_version {version!r} (this polca speaks {SCHEMA_VERSION})"
        raise SchemaError(msg)
    try:
        if expected is not None:
            return expected.model_validate(raw)
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        msg = f"{exc.error_count()} schema error(s), first at {where}: {first['msg']}"
        raise SchemaError(msg) from exc


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every payload kind, for ``docs/mqtt.md``."""
    return {
        model.__name__: model.model_json_schema()
        for model in (
            Telemetry,
            Status,
            State,
            Event,
            Control,
            Assignment,
            Meter,
            PolicyBundle,
            RowSummary,
            CduTelemetry,
            CoolingLoopState,
            CoolingAlarm,
        )
    }
