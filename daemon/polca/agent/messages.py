"""The messages a node agent publishes, built from a snapshot of what it knows (pure).

One function per channel of the node (``docs/mqtt.md``): ``status`` (retained, and the
Last Will), ``state`` (retained: the caps in force and why), ``event`` (one notable
change) and ``telemetry`` (one per interval, from the records ``window.TelemetryWindow``
folded). Each takes a ``NodeSnapshot`` (an immutable copy the core makes, never the core
itself) and returns what to publish; the sequence number, the stamps and the lease come
in as arguments. Nothing here publishes, reads a clock, counts or touches a GPU, and
nothing imports the core (``core.py`` imports this module, not the other way round).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from polca import __version__
from polca.agent.control import Lease
from polca.assign.model import Workload
from polca.policy import Decision, GpuTarget
from polca.telemetry.messages import BusStats, OutMessage
from polca.telemetry.schema import (
    AgentHealth,
    Event,
    GpuCaps,
    GpuTelemetry,
    State,
    Status,
    Telemetry,
    WorkloadRef,
    encode,
)
from polca.telemetry.topics import NodeAddress, Topics


@dataclass(frozen=True, slots=True)
class Identity:
    """What a node's status says about the agent itself."""

    backend: str
    observe_only: bool
    started_ns: int


@dataclass(frozen=True, slots=True)
class AssignmentState:
    """Where the node's GPU classes come from, and for each GPU where its class came from
    and who holds it (by GPU index)."""

    source: str = "mqtt"
    healthy: bool = True
    reason: str = ""
    origins: Mapping[int, str] = field(default_factory=dict)
    workloads: Mapping[int, Workload] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What the node's messages say about the agent, copied at one moment.

    Made by ``AgentCore.snapshot``; the mappings are read-only copies, so a snapshot does
    not change when the core does.
    """

    addr: NodeAddress
    topics: Topics
    identity: Identity
    observe_only: bool
    gpu_count: int
    lost: frozenset[int]
    decision: Decision | None
    targets: tuple[GpuTarget, ...]  # the caps in force, one per GPU
    outcome_errors: Mapping[int, str]  # GPU index -> why its caps are not applied
    locked_sm_clock_max_mhz: Mapping[int, int | None]  # GPU index -> lock ceiling or None
    policy_name: str | None
    policy_revision: str | None
    crash_loop: str | None
    skew_s: float | None
    clock_skewed: bool
    assignment: AssignmentState = field(default_factory=AssignmentState)
    mqtt_endpoint: str | None = None  # the broker endpoint in use, while connected

    @property
    def level(self) -> int:
        """The level in force (0 before any decision)."""
        return self.decision.level if self.decision else 0

    @property
    def fail_safe(self) -> bool:
        """Whether the decision in force is the fail-safe."""
        return self.decision.fail_safe if self.decision else False

    def classes(self) -> dict[int, str]:
        """Each GPU's priority class in the decision in force."""
        return {t.index: t.priority_class for t in self.targets}

    def applied(self, index: int) -> bool:
        """Whether GPU ``index`` holds the caps in force (not observe-only, no failed write)."""
        return not self.observe_only and index not in self.outcome_errors


def status(
    snapshot: NodeSnapshot, state: str, *, now_ns: int, reason: str | None = None
) -> OutMessage:
    """The node's retained status (``online``/``offline``); the Last Will is one too.

    Online, its ``reason`` is the crash loop the agent started in, if any.
    """
    identity = snapshot.identity
    message = Status(
        ts_ns=now_ns,
        state=state,
        node=snapshot.addr.node,
        agent_version=__version__,
        backend=identity.backend,
        gpu_count=snapshot.gpu_count,
        observe_only=identity.observe_only,
        policy_name=snapshot.policy_name,
        policy_revision=snapshot.policy_revision,
        started_ns=identity.started_ns,
        reason=reason if reason is not None or state == "offline" else snapshot.crash_loop,
        clock_skew_s=snapshot.skew_s if snapshot.clock_skewed else None,
        assignment_source=snapshot.assignment.source,
        assignment_healthy=snapshot.assignment.healthy,
        assignment_reason=snapshot.assignment.reason[:256] or None,
        mqtt_endpoint=snapshot.mqtt_endpoint if state == "online" else None,
    )
    topic = snapshot.topics.node(snapshot.addr, "status")
    return OutMessage(topic, encode(message), qos=1, retain=True)


def state(
    snapshot: NodeSnapshot, *, lease: Lease | None, seq: int, now_ns: int, now_mono_ns: int
) -> OutMessage:
    """The node's retained state: every GPU's caps in force and why.

    ``lease`` is the control lease in force at ``now_mono_ns`` (None: none).
    """
    gpus = []
    for target in snapshot.targets:
        limit = target.power_limit_mw
        gpus.append(
            GpuCaps(
                index=target.index,
                uuid=target.uuid,
                priority_class=target.priority_class,
                sm_clock_max_mhz=target.sm_clock_max_mhz,
                power_limit_w=None if limit is None else limit / 1000.0,
                reasons=target.reasons,
                applied=snapshot.applied(target.index),
                error=snapshot.outcome_errors.get(target.index),
            )
        )
    message = State(
        ts_ns=now_ns,
        seq=seq,
        node=snapshot.addr.node,
        level=snapshot.level,
        fail_safe=snapshot.fail_safe,
        observe_only=snapshot.observe_only,
        # Display only: the lease's end on this node's wall clock.
        lease_expires_ns=max(0, now_ns + lease.expires_mono_ns - now_mono_ns) if lease else None,
        control_seq=lease.control.seq if lease else None,
        policy_revision=snapshot.policy_revision,
        gpus=tuple(gpus),
    )
    topic = snapshot.topics.node(snapshot.addr, "state")
    return OutMessage(topic, encode(message), qos=1, retain=True)


def event(
    addr: NodeAddress,
    topics: Topics,
    name: str,
    *,
    seq: int,
    now_ns: int,
    gpu: int | None,
    uuid: str | None,
    detail: Mapping[str, Any],
) -> OutMessage:
    """One event of the node at ``addr``.

    Raises pydantic's ``ValidationError`` (a ``ValueError``) when ``detail`` does not fit
    the wire; the caller decides what that means.
    """
    message = Event(
        ts_ns=now_ns,
        seq=seq,
        node=addr.node,
        event=name,
        gpu=gpu,
        uuid=uuid,
        detail=dict(detail),
    )
    return OutMessage(topics.node(addr, "events"), encode(message), qos=1)


@dataclass(frozen=True, slots=True)
class Health:
    """The agent's own counters for one telemetry message."""

    ticks: int
    tick_p99_ms: float | None
    gpu_call_p99_ms: float | None
    bus: BusStats | None
    rejected: int
    gpu_errors: int = 0

    @classmethod
    def of(
        cls,
        *,
        ticks: int,
        tick_durations_s: Collection[float],
        gpu_call_p99_s: float | None,
        bus: BusStats | None,
        rejected: int,
        gpu_errors: int = 0,
    ) -> Health:
        """From the raw counters: the p99 of the recent tick durations, in ms."""
        ordered = sorted(tick_durations_s)
        tick_p99_ms = (
            round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3)
            if ordered
            else None
        )
        call_p99_ms = round(gpu_call_p99_s * 1000, 3) if gpu_call_p99_s is not None else None
        return cls(ticks, tick_p99_ms, call_p99_ms, bus, rejected, gpu_errors)


def with_assignment(
    records: Sequence[GpuTelemetry],
    assignment: AssignmentState,
    mig: Mapping[int, tuple[str, ...]] | None = None,
) -> list[GpuTelemetry]:
    """The GPUs' records with where each one's class came from, who holds it and its MIG
    devices; a workload whose names do not fit the wire is left out (the class stays)."""
    out: list[GpuTelemetry] = []
    mig = mig or {}
    for record in records:
        origin = assignment.origins.get(record.index)
        workload = assignment.workloads.get(record.index)
        instances = mig.get(record.index, ())[:16]
        if instances:
            record = record.model_copy(update={"mig_instances": instances})  # noqa: PLW2901
        if origin is None and workload is None:
            out.append(record)
            continue
        ref = None
        if workload is not None:
            try:
                ref = WorkloadRef(
                    namespace=workload.namespace, pod=workload.pod, container=workload.container
                )
            except ValidationError:
                ref = None
        out.append(record.model_copy(update={"class_origin": origin, "workload": ref}))
    return out


def telemetry(
    snapshot: NodeSnapshot,
    *,
    gpus: Sequence[GpuTelemetry],
    node_gpu_power_w: float,
    node_energy_delta_j: float,
    seq: int,
    interval_s: float,
    health: Health,
    now_ns: int,
) -> tuple[Telemetry, OutMessage]:
    """One telemetry message of the node from one interval's records (``window.drain``).

    Raises pydantic's ``ValidationError`` when a value does not fit the wire.
    """
    bus = health.bus
    message = Telemetry(
        ts_ns=now_ns,
        seq=seq,
        node=snapshot.addr.node,
        interval_s=interval_s,
        node_gpu_power_w=node_gpu_power_w,
        node_energy_delta_j=node_energy_delta_j,
        level=snapshot.level,
        fail_safe=snapshot.fail_safe,
        gpus=tuple(gpus),
        health=AgentHealth(
            ticks=health.ticks,
            tick_p99_ms=health.tick_p99_ms,
            gpu_call_p99_ms=health.gpu_call_p99_ms,
            outbox_dropped=bus.outbox_dropped if bus else 0,
            inbox_dropped=bus.inbox_dropped if bus else 0,
            control_rejected=health.rejected,
            reconnects=max(0, bus.connects - 1) if bus else 0,
            gpu_errors=health.gpu_errors,
            clock_skew_s=snapshot.skew_s,
        ),
    )
    topic = snapshot.topics.node(snapshot.addr, "telemetry")
    return message, OutMessage(topic, encode(message), qos=0)


def status_line(snapshot: NodeSnapshot) -> str:
    """systemd's ``STATUS=``: GPUs, mode, policy, clock skew, crash loop."""
    mode = "fail-safe" if snapshot.fail_safe else f"level {snapshot.level}"
    lost = f", {len(snapshot.lost)} lost" if snapshot.lost else ""
    skew = (
        f", clock off by {snapshot.skew_s:+.1f} s"
        if snapshot.clock_skewed and snapshot.skew_s
        else ""
    )
    loop = f"; {snapshot.crash_loop}" if snapshot.crash_loop else ""
    revision = snapshot.policy_revision or "none"
    return f"{snapshot.gpu_count} GPUs{lost}, {mode}, policy {revision}{skew}{loop}"
