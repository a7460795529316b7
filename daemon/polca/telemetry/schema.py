"""The versioned MQTT wire schema, shared by the agent, the aggregator and the tools.

Every payload is a JSON object with ``schema_version`` (an unknown version is rejected,
loudly), a ``kind`` discriminator and ``ts_ns`` (Unix time in nanoseconds). Values carry
their unit in the key (``power_w``, ``temp_c``, ``sm_clock_mhz``). ``docs/mqtt.md`` embeds
the JSON Schema of every payload, generated from these models.

Received payloads are hostile until validated. ``decode()`` is total: it returns a valid
model or raises ``SchemaError`` (a subclass names the drop reason), never anything else.
The payload is bounded before parsing (``MAX_PAYLOAD_BYTES``) and parsed straight into the
models by pydantic's JSON parser, which bounds nesting depth and refuses invalid UTF-8 and
lone surrogates. Validation is strict on the wire: no string or bool coerced to a number,
``schema_version`` the integer 1 exactly, finite floats only, integers within int64, every
string, list and map bounded, unknown keys rejected. What the decoder cannot judge alone
(identity against the topic, timestamps against the receiver's clock) is checked by
``polca.telemetry.checks``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from polca.errors import OversizedError, SchemaError, SchemaVersionError

SCHEMA_VERSION = 1
MAX_PAYLOAD_BYTES = 256 * 1024
INT64_MAX = 2**63 - 1
"""Largest integer accepted on the wire (timestamps, sequence numbers, counters)."""

MAX_POLICY_TEXT_CHARS = 64 * 1024
"""A policy bundle's text, as ``polca.policy.loader.MAX_POLICY_BYTES`` bounds a policy file."""
MAX_DETAIL_DEPTH = 8
"""Nesting depth allowed inside an event's free-form ``detail``."""
MAX_NODE_W = 1e7
"""One node's (or one GPU's) power on the wire: far above any real node."""
MAX_TOTAL_W = 1e12
"""A sum of nodes on the wire (a rack, a row, a meter, a budget): room for the largest
configuration the aggregator accepts (``aggregator.config``), so no summary it builds
from validated values can fail validation."""
MAX_ROW_NODES = 4096
"""Nodes a row summary can list (and so the most nodes one row may have)."""
MAX_ROW_RACKS = 1024
"""Racks a row summary can list (and so the most racks one row may have)."""

_Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
_Watts = Annotated[float, Field(ge=0, le=MAX_NODE_W)]
_TotalWatts = Annotated[float, Field(ge=0, le=MAX_TOTAL_W)]
_Temp = Annotated[float, Field(ge=-60, le=300)]
_Mhz = Annotated[int, Field(ge=0, le=100_000)]
_Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
_Ns = Annotated[int, Field(ge=0, le=INT64_MAX)]
_Level = Annotated[int, Field(ge=0, le=64)]
_Label = Annotated[str, Field(max_length=64)]

# Strict on the wire (``decode`` validates with strict=True); lax for polca's own objects.
# Non-finite floats are refused in both.
BudgetOrigin = Literal["config", "lease", "fallback", "feeds"]
"""Where a row's electrical budget comes from (``aggregator/budgets.py``)."""

_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

__all__ = ["INT64_MAX", "MAX_PAYLOAD_BYTES", "SCHEMA_VERSION", "SchemaError", "decode", "encode"]


class _Wire(BaseModel):
    model_config = _CONFIG

    schema_version: Literal[1] = 1
    ts_ns: _Ns = Field(description="Unix time of the message in nanoseconds.")

    @field_validator("schema_version", mode="before")
    @classmethod
    def _exact_version(cls, value: object) -> object:
        # Literal[1] would also take true and 1.0 (they compare equal to 1).
        if type(value) is not int:
            msg = f"schema_version must be the integer {SCHEMA_VERSION}"
            raise ValueError(msg)
        return value


class GpuHealthReport(BaseModel):
    """A GPU's health counters (``polca.gpu.backend.GpuHealth``); null where unsupported.

    Sent with a GPU's telemetry when a counter changed, and at least every
    ``agent.health_every_s`` otherwise.
    """

    model_config = _CONFIG

    xid_errors: _Count | None = Field(None, description="XID events since the agent started.")
    last_xid: _Count | None = Field(None, description="Code of the last XID event.")
    ecc_corrected_volatile: _Count | None = Field(None, description="Since the driver loaded.")
    ecc_uncorrected_volatile: _Count | None = None
    ecc_corrected_aggregate: _Count | None = Field(None, description="Over the GPU's life.")
    ecc_uncorrected_aggregate: _Count | None = None
    retired_pages_sbe: _Count | None = Field(None, description="Pages retired (single bit).")
    retired_pages_dbe: _Count | None = Field(None, description="Pages retired (double bit).")
    retired_pages_pending: _Count | None = Field(None, le=1, description="1: retirement pending.")
    remapped_rows_correctable: _Count | None = None
    remapped_rows_uncorrectable: _Count | None = None
    row_remap_pending: _Count | None = Field(None, le=1, description="1: a reset is needed.")
    row_remap_failure: _Count | None = Field(None, le=1, description="1: a remap failed.")
    pcie_replays: _Count | None = Field(None, description="PCIe replays since driver load.")
    power_brake_s: float | None = Field(None, ge=0, le=1e12, description="Power brake time.")
    hw_thermal_slowdown_s: float | None = Field(None, ge=0, le=1e12)
    sw_thermal_slowdown_s: float | None = Field(None, ge=0, le=1e12)


class WorkloadRef(BaseModel):
    """The workload holding a GPU: a Kubernetes pod's namespace, name and container."""

    model_config = _CONFIG

    namespace: str = Field(max_length=63)
    pod: str = Field(max_length=253)
    container: str = Field("", max_length=63)


ClassOrigin = Literal[
    "mqtt", "file", "annotation", "priority", "namespace", "default", "idle", "fallback"
]
"""Where a GPU's runtime class came from (``polca.assign.model.Origin``)."""


class GpuTelemetry(BaseModel):
    """One GPU over one publish interval (min/mean/max over the samples taken)."""

    model_config = _CONFIG

    index: int = Field(ge=0, le=1023)
    uuid: _Name
    name: str = Field(max_length=128)
    priority_class: _Name | None = None
    class_origin: ClassOrigin | None = Field(
        None, description="Where the GPU's runtime class came from (none: the policy's map)."
    )
    workload: WorkloadRef | None = Field(None, description="Who holds the GPU, when known.")
    mig_instances: tuple[_Name, ...] = Field(
        (), max_length=16, description="MIG mode: the UUIDs of its MIG devices (caps stay here)."
    )
    state: Literal["ok", "lost", "error"] = "ok"
    samples: _Count = Field(0, description="Samples aggregated into this message.")
    power_w: _Watts | None = Field(None, description="Last instantaneous power.")
    power_min_w: _Watts | None = None
    power_mean_w: _Watts | None = None
    power_max_w: _Watts | None = None
    power_avg_w: _Watts | None = Field(None, description="Driver-averaged power (about 1 s).")
    energy_j: float | None = Field(
        None, ge=0, le=1e18, description="Energy counter since driver load."
    )
    energy_delta_j: float | None = Field(
        None, ge=0, le=1e12, description="Energy over the interval."
    )
    gpu_temp_c: _Temp | None = None
    gpu_temp_max_c: _Temp | None = None
    mem_temp_c: _Temp | None = None
    sm_clock_mhz: _Mhz | None = None
    mem_clock_mhz: _Mhz | None = None
    gpu_util_pct: float | None = Field(None, ge=0, le=100)
    mem_util_pct: float | None = Field(None, ge=0, le=100)
    power_limit_w: _Watts | None = None
    enforced_power_limit_w: _Watts | None = None
    power_limit_max_w: _Watts | None = Field(
        None,
        description="The highest power limit the GPU accepts (from discovery): what it can "
        "draw, which bounds the node's plausible power at the aggregator.",
    )
    clock_event_reasons: _Count | None = Field(None, description="NVML bitmask, OR-ed.")
    clock_events: tuple[_Label, ...] = Field(
        (), max_length=64, description="Names of the bits set."
    )
    locked_sm_clock_max_mhz: _Mhz | None = None
    health: GpuHealthReport | None = Field(
        None, description="Health counters, when they changed or are due."
    )


class AgentHealth(BaseModel):
    """The agent's own health counters, published with telemetry."""

    model_config = _CONFIG

    ticks: _Count = 0
    tick_p99_ms: float | None = Field(None, ge=0, le=1e9)
    gpu_call_p99_ms: float | None = Field(None, ge=0, le=1e9)
    outbox_dropped: _Count = 0
    inbox_dropped: _Count = 0
    control_rejected: _Count = 0
    reconnects: _Count = 0
    gpu_errors: _Count = Field(0, description="GPU library calls that failed, since start.")
    clock_skew_s: float | None = Field(
        None,
        ge=-1e9,
        le=1e9,
        description="This node's clock minus its controller's, from the last live control "
        "message (includes the broker's latency).",
    )


class Telemetry(_Wire):
    """``.../<node>/telemetry``: one message per node per publish interval, QoS 0."""

    kind: Literal["telemetry"] = "telemetry"
    seq: _Count
    node: _Name
    interval_s: float = Field(gt=0, le=3600)
    node_gpu_power_w: _Watts = Field(description="Sum of the GPUs' mean power.")
    node_energy_delta_j: float = Field(ge=0, le=1e12)
    level: _Level = Field(0, description="Control level in force.")
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
    started_ns: _Ns | None = None
    reason: str | None = Field(
        None, max_length=256, description="Why offline, when known; or a crash loop when online."
    )
    clock_skew_s: float | None = Field(
        None,
        ge=-1e9,
        le=1e9,
        description="Clock skew against the controller, when beyond the tolerance.",
    )
    assignment_source: Literal["mqtt", "kubernetes", "file"] | None = Field(
        None, description="An agent: where its GPUs' classes come from."
    )
    assignment_healthy: bool | None = Field(
        None, description="An agent: whether that source can be read (else: the fallback)."
    )
    assignment_reason: str | None = Field(
        None, max_length=256, description="An agent: why its assignment source is unhealthy."
    )
    mqtt_endpoint: str | None = Field(
        None,
        max_length=262,
        description="The broker endpoint (`host:port`) the process published this through.",
    )
    shard: str | None = Field(
        None, max_length=256, description="An aggregator elected on etcd: its shard."
    )
    role: Literal["leader", "standby"] | None = Field(
        None, description="An aggregator elected on etcd: whether it leads its shard."
    )
    term: _Count | None = Field(None, description="The shard leader's term, as this one knows.")
    leader: _Name | None = Field(None, description="The shard's leader, as this one knows.")


class GpuCaps(BaseModel):
    """The caps in force on one GPU and why."""

    model_config = _CONFIG

    index: int = Field(ge=0, le=1023)
    uuid: _Name
    priority_class: _Name
    sm_clock_max_mhz: _Mhz | None
    power_limit_w: _Watts | None
    reasons: tuple[_Label, ...] = Field((), max_length=64)
    applied: bool = True
    error: str | None = Field(None, max_length=512)


class State(_Wire):
    """``.../<node>/state``: retained, QoS 1: the caps in force on every GPU and why."""

    kind: Literal["state"] = "state"
    seq: _Count
    node: _Name
    level: _Level
    fail_safe: bool
    observe_only: bool = False
    lease_expires_ns: _Ns | None = None
    control_seq: _Count | None = None
    policy_revision: str | None = Field(None, max_length=64)
    gpus: tuple[GpuCaps, ...] = Field(max_length=1024)


class Event(_Wire):
    """``.../<node>/events``: QoS 1, one per notable change (cap applied, GPU lost, ...)."""

    kind: Literal["event"] = "event"
    seq: _Count
    node: _Name
    event: _Name
    gpu: int | None = Field(None, ge=0, le=1023)
    uuid: _Name | None = None
    detail: dict[_Label, JsonValue] = Field(default_factory=dict, max_length=64)

    @field_validator("detail")
    @classmethod
    def _bounded_detail(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        _check_json(value, depth=0)
        return value


class Control(_Wire):
    """``{root}/{site}/{row}[/{rack}]/control``: retained, QoS 1, from the row controller.

    Ordering: a message is newer when ``(epoch_ns, seq)`` is greater than the last one
    accepted for the same scope; ``epoch_ns`` is the issuer's start time, so a restarted
    controller supersedes its predecessor. Above that, ``term`` fences: the leadership
    term of an aggregator elected on etcd (0 without high availability); an agent follows
    the highest term it has seen and ignores lower ones (docs/ha.md). The lease lasts
    ``lease_expires_ns - issued_ns`` from receipt on the agent's monotonic clock, cut to
    the policy's maximum; wall clocks only order messages and age retained ones
    (docs/mqtt.md, "Control and leases").
    """

    kind: Literal["control"] = "control"
    scope: Literal["row", "rack"]
    row: _Name
    rack: _Name | None = None
    issuer: _Name
    term: _Count = 0
    epoch_ns: _Ns
    seq: _Count
    level: _Level
    level_name: str = Field("", max_length=64)
    issued_ns: _Ns
    lease_expires_ns: _Ns
    policy_revision: str | None = Field(None, max_length=64)
    observe: bool = Field(False, description="Shadow mode: agents log but do not apply.")
    reason: str = Field("", max_length=512)


class Assignment(_Wire):
    """``.../<node>/assign``: retained priority classes from a scheduler.

    Keys are GPU UUIDs or indices (as strings); values are class names of the policy.
    """

    kind: Literal["assignment"] = "assignment"
    seq: _Count = 0
    classes: dict[Annotated[str, Field(min_length=1, max_length=128)], _Name] = Field(
        max_length=1024
    )


class SourceState(BaseModel):
    """What one answering meter source's equipment says of the feed it measures.

    ``equipment`` is the device's own word (a Redfish circuit's ``BreakerState`` and
    ``PowerState``, a UPS's ``upsOutputSource``, a PDU's input voltage): ``down`` when it
    says the feed carries nothing, ``unknown`` when it does not say. A source that did not
    answer is in the meter's ``missing``, not here (loss of contact).
    """

    model_config = _CONFIG

    equipment: Literal["up", "down", "unknown"] = "unknown"
    on_battery: bool = Field(False, description="A UPS whose output its battery carries.")
    battery_minutes: float | None = Field(
        None, ge=0, le=2**31, description="A UPS's estimated minutes on battery."
    )
    load_pct: float | None = Field(None, ge=0, le=200, description="A UPS's output load.")
    input_voltage_v: float | None = Field(
        None, ge=0, le=100_000, description="The feed's input voltage, where read."
    )


LOST_CONTACT_REASONS = frozenset({"unreachable", "timeout"})
"""The ``Meter.missing`` reasons of a source that did not answer at all (loss of contact:
for a meter powered by the feed it measures, the first sign the feed is gone)."""


class Meter(_Wire):
    """``{root}/{site}/{row}/meter`` (or a configured topic): row power from a PDU or meter.

    ``polca meter`` sums a row's sources (A and B feeds, several PDUs). When one fails the
    reading is ``partial``: ``power_w`` is the sum of the others, ``missing`` says which
    failed and why, and the aggregator never takes it as the row's power.
    """

    kind: Literal["meter"] = "meter"
    power_w: _TotalWatts
    energy_j: float | None = Field(None, ge=0, le=1e18, description="Meter energy counter, if any.")
    sources: _Count = Field(1, le=256, description="Sources summed in power_w.")
    partial: bool = Field(
        False, description="Some sources failed: not the row's power (see missing)."
    )
    missing: dict[_Name, _Label] = Field(
        default_factory=dict, max_length=256, description="Failed source -> why (partial)."
    )
    states: dict[_Name, SourceState] = Field(
        default_factory=dict,
        max_length=256,
        description="Answering source -> what its equipment says of its feed.",
    )


class Budget(_Wire):
    """``{root}/{site}/{row}/budget``: retained, QoS 1: a row's budget from the site controller.

    The site controller shares each power domain's live capacity among the rows it feeds
    (``powertree``); the row's aggregator runs on the least of its configured budget and
    this one while the lease lasts (``lease_expires_ns - issued_ns`` from receipt, on its
    monotonic clock), and on its ``fallback_budget_w`` once it lapses. Ordered and fenced
    as ``Control`` is (``term``, then ``(epoch_ns, seq)``); only the site controller's
    broker role may publish it.
    """

    kind: Literal["budget"] = "budget"
    row: _Name
    issuer: _Name
    term: _Count = 0
    epoch_ns: _Ns
    seq: _Count
    budget_w: _TotalWatts
    issued_ns: _Ns
    lease_expires_ns: _Ns
    limited_by: _Name | None = Field(
        None, description="The domain whose capacity set it (none: the row's own rating)."
    )
    reason: str = Field("", max_length=512)


class BudgetLimit(_Wire):
    """``{root}/{site}/powertree/limit/{domain}``: retained, QoS 1: an operator's limit.

    ``polca budget set`` publishes it (``watts``: the domain's capacity is never above it,
    ``until_ns``: the window's end, none: until cleared) and ``polca budget clear`` a
    limit of no ``watts``; only the operator's broker role may publish it. Each carries
    who set it and why: the site controller logs it (``domain_limit_set``) and shows it.
    """

    kind: Literal["budget_limit"] = "budget_limit"
    domain: _Name
    watts: _TotalWatts | None = Field(None, description="None: the limit is cleared.")
    until_ns: _Ns | None = Field(None, description="Unix time the limit ends (none: cleared).")
    reason: str = Field(min_length=1, max_length=512)
    by: str = Field(min_length=1, max_length=128, description="Who set it (user@host).")


class FeedReport(BaseModel):
    """One feed of a domain as the site controller sees it."""

    model_config = _CONFIG

    name: _Name
    rating_w: _TotalWatts
    up: bool
    equipment: Literal["up", "down", "unknown"] = "unknown"
    dark_polls: _Count = 0


class DomainReport(BaseModel):
    """One domain of the power tree as the site controller sees it."""

    model_config = _CONFIG

    name: _Name
    kind: _Name
    parent: _Name | None = None
    rating_w: _TotalWatts
    capacity_w: _TotalWatts = Field(description="What it can carry now, its limit included.")
    unlimited_w: _TotalWatts = Field(description="What its feeds can carry now, no limit.")
    budget_w: _TotalWatts
    nominal_w: _TotalWatts
    measured_w: _TotalWatts
    on_battery: bool = False
    feeds: tuple[FeedReport, ...] = Field((), max_length=16)
    limit_w: _TotalWatts | None = None
    limit_until_ns: _Ns | None = None
    limit_reason: str = Field("", max_length=512)
    limit_by: str = Field("", max_length=128)


class RowBudgetReport(BaseModel):
    """One row of the power tree: its budget and where it comes from."""

    model_config = _CONFIG

    name: _Name
    parent: _Name | None = None
    rating_w: _TotalWatts
    budget_w: _TotalWatts
    nominal_w: _TotalWatts
    measured_w: _TotalWatts | None = None
    limited_by: _Name | None = None
    origin: BudgetOrigin | None = Field(
        None, description="The budget the row's aggregator says it runs on."
    )
    stale: bool = False


class SiteReport(_Wire):
    """``{root}/{site}/powertree/state``: retained: the tree as the site controller sees it."""

    kind: Literal["site_report"] = "site_report"
    issuer: _Name
    term: _Count = 0
    publishing: bool = Field(description="This controller publishes the budgets (it leads).")
    domains: tuple[DomainReport, ...] = Field((), max_length=512)
    rows: tuple[RowBudgetReport, ...] = Field((), max_length=512)
    truncated: bool = Field(False, description="Domains or rows were cut to fit the wire.")


class PolicyBundle(_Wire):
    """``{root}/{site}/{row}/policy``: retained, QoS 1: the node policy, from the aggregator.

    ``text`` is the policy YAML exactly as validated by the aggregator; agents validate it
    again, apply it, and keep it as their last good copy. ``revision`` is the first 12 hex
    digits of the SHA-256 of ``text``.
    """

    kind: Literal["policy"] = "policy"
    name: str = Field(max_length=128)
    revision: str = Field(pattern=r"^[0-9a-f]{12}$")
    text: str = Field(max_length=MAX_POLICY_TEXT_CHARS)
    source: str = Field("", max_length=512, description="Where the aggregator read it.")


class RackSummary(BaseModel):
    """One rack inside a row summary."""

    model_config = _CONFIG

    rack: _Name
    power_w: _TotalWatts
    budget_w: _TotalWatts | None = Field(None, description="Effective: electrical or thermal.")
    thermal_budget_w: _TotalWatts | None = Field(None, description="From its cooling loop.")
    level: _Level = Field(0, description="Rack-scope level, when it has one.")
    nodes_online: _Count
    nodes_stale: _Count
    nodes_offline: _Count


class ClassPower(BaseModel):
    """One priority class's GPU power in a row."""

    model_config = _CONFIG

    priority_class: _Name
    power_w: _TotalWatts


class RowSummary(_Wire):
    """``{root}/{site}/{row}/summary``: retained: the row as the aggregator sees it."""

    kind: Literal["row_summary"] = "row_summary"
    row: _Name
    issuer: _Name
    power_w: _TotalWatts
    power_source: Literal["computed", "meter"]
    power_note: str = Field(
        "", max_length=512, description="Why a fresh meter reading was not used, if one was not."
    )
    budget_w: _TotalWatts
    effective_budget_w: _TotalWatts
    electrical_budget_w: _TotalWatts | None = Field(
        None, description="The electrical budget in force (before the loops' thermal ones)."
    )
    budget_origin: BudgetOrigin = Field(
        "config",
        description="Where the electrical budget comes from: the row's configuration, the "
        "site controller's lease, the fallback once a lease lapsed, the feeds up.",
    )
    budget_limited_by: str | None = Field(
        None, max_length=256, description="The domain of a leased budget, or the feeds down."
    )
    leased_budget_w: _TotalWatts | None = Field(
        None, description="The site controller's budget while its lease is valid."
    )
    feeds: dict[_Name, bool] = Field(
        default_factory=dict, max_length=16, description="Each listed feed: whether it is up."
    )
    floor_w: _TotalWatts | None = Field(
        None, description="What the row's nodes draw at the fail-safe caps."
    )
    power_by_class: tuple[ClassPower, ...] = Field(
        (), max_length=64, description="GPU power per priority class, most important first."
    )
    level: _Level
    level_name: str = Field("", max_length=64)
    thresholds_w: tuple[float, ...] = Field((), max_length=64)
    trend_w_per_s: float | None = None
    lease_expires_ns: _Ns | None = None
    observe: bool = False
    racks: tuple[RackSummary, ...] = Field((), max_length=MAX_ROW_RACKS)
    offline_nodes: tuple[_Name, ...] = Field((), max_length=MAX_ROW_NODES)
    stale_nodes: tuple[_Name, ...] = Field((), max_length=MAX_ROW_NODES)
    implausible_nodes: tuple[_Name, ...] = Field(
        (),
        max_length=MAX_ROW_NODES,
        description="Nodes whose last telemetry claimed more than they can draw (counted at "
        "their plausible bound) or listed GPUs they do not have.",
    )
    truncated: bool = Field(
        False,
        description="Node lists (then racks) were cut to keep the message within the wire's "
        "size; the racks' counts are whole.",
    )


class CoolantConnector(BaseModel):
    """One side of a CDU (Redfish ``CoolantConnector``): supply, return, flow, pressure.

    ``secondary`` is the technology cooling system loop to the racks, ``primary`` the
    facility water. Every reading is optional: a CDU reports what it measures.
    """

    model_config = _CONFIG

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

    model_config = _CONFIG

    name: _Name
    state: Literal["running", "standby", "failed", "off"]
    speed_pct: float | None = Field(None, ge=0, le=100, description="Redfish PumpSpeedPercent.")


class LeakDetector(BaseModel):
    """One leak detector (Redfish ``LeakDetector``; ``DetectorState`` OK/Warning/Critical)."""

    model_config = _CONFIG

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

    model_config = _CONFIG

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
    forced_levels: dict[_Name, _Level] = Field(default_factory=dict, max_length=1024)


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
    | Budget
    | BudgetLimit
    | SiteReport
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


_M = TypeVar("_M", bound=BaseModel)


_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type", "model_class"})


class _Envelope(BaseModel):
    """Only the version, to tell an unknown version from a malformed payload."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1]


@overload
def decode(payload: bytes) -> Message: ...


@overload
def decode(payload: bytes, expected: type[_M]) -> _M: ...


def decode(payload: bytes, expected: type[BaseModel] | None = None) -> BaseModel:
    """Parse and validate a payload (of kind ``expected``, else any kind); total.

    Raises:
        SchemaError: for every problem, never another exception; ``OversizedError`` before
            parsing, ``SchemaVersionError`` for an unknown version.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        msg = f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}"
        raise OversizedError(msg)
    try:
        if expected is not None:
            return expected.model_validate_json(payload, strict=True)
        return _ADAPTER.validate_json(payload, strict=True)
    except ValidationError as exc:
        raise _schema_error(payload, exc) from exc
    except (ValueError, TypeError, RecursionError) as exc:
        # Not expected from pydantic's parser; the decoder stays total regardless.
        msg = f"undecodable payload: {type(exc).__name__}: {exc}"
        raise SchemaError(msg) from exc


def _schema_error(payload: bytes, exc: ValidationError) -> SchemaError:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return SchemaError(f"not JSON: {first['msg']}")
    if first["loc"] == () and first["type"] in _NOT_AN_OBJECT:
        return SchemaError(f"expected a JSON object: {first['msg']}")
    try:
        _Envelope.model_validate_json(payload, strict=True)
    except ValidationError as env:
        error = env.errors(include_url=False)[0]
        if error["loc"] == ("schema_version",):
            seen = "none" if error["type"] == "missing" else repr(error["input"])[:32]
            return SchemaVersionError(
                f"unsupported schema_version {seen} (this polca speaks {SCHEMA_VERSION})"
            )
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    return SchemaError(f"{exc.error_count()} schema error(s), first at {where}: {first['msg']}")


def _check_json(value: JsonValue, *, depth: int) -> None:
    """Bound free-form JSON: nesting depth, finite numbers, string length."""
    if depth > MAX_DETAIL_DEPTH:
        msg = f"nested deeper than {MAX_DETAIL_DEPTH} levels"
        raise ValueError(msg)
    if isinstance(value, float) and not math.isfinite(value):
        msg = "numbers must be finite"
        raise ValueError(msg)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        msg = "integers must fit in 64 bits"
        raise ValueError(msg)
    if isinstance(value, str) and len(value) > 4096:
        msg = "strings must be at most 4096 characters"
        raise ValueError(msg)
    if isinstance(value, list):
        for item in value:
            _check_json(item, depth=depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, depth=depth + 1)
            _check_json(item, depth=depth + 1)


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
            Budget,
            BudgetLimit,
            SiteReport,
            PolicyBundle,
            RowSummary,
            CduTelemetry,
            CoolingLoopState,
            CoolingAlarm,
        )
    }
