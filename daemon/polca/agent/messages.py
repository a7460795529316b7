"""The messages a node agent publishes, built from what it knows (pure).

One function per channel of the node (``docs/mqtt.md``): ``status`` (retained, and the
Last Will), ``state`` (retained: the caps in force and why), ``event`` (one notable
change) and ``telemetry`` (one per interval, from the samples folded by
``window.TelemetryWindow``). Each returns the ``OutMessage`` to publish; nothing here
publishes, reads a clock or touches a GPU: stamps and the lease's end come in as arguments.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import ValidationError

from polca import __version__
from polca.telemetry.bus import BusStats, OutMessage
from polca.telemetry.schema import (
    AgentHealth,
    Event,
    GpuCaps,
    GpuHealthReport,
    State,
    Status,
    Telemetry,
    encode,
)

if TYPE_CHECKING:
    from polca.agent.actuator import Setting
    from polca.agent.core import AgentCore
    from polca.agent.window import TelemetryWindow

_log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Identity:
    """What a node's status says about the agent itself."""

    backend: str
    observe_only: bool
    started_ns: int


def status(core: AgentCore, state: str, *, now_ns: int, reason: str | None = None) -> OutMessage:
    """The node's retained status (``online``/``offline``); the Last Will is one too.

    Online, its ``reason`` is the crash loop the agent started in, if any.
    """
    identity = core.identity
    crash_loop = core.crash_loop
    current = core.policy_store.current
    message = Status(
        ts_ns=now_ns,
        state=state,
        node=core.addr.node,
        agent_version=__version__,
        backend=identity.backend,
        gpu_count=len(core.infos),
        observe_only=identity.observe_only,
        policy_name=current.policy.name if current else None,
        policy_revision=current.revision if current else None,
        started_ns=identity.started_ns,
        reason=reason if reason is not None or state == "offline" else crash_loop,
        clock_skew_s=core.skew_s if core.clock_skewed else None,
    )
    topic = core.topics.node(core.addr, "status")
    return OutMessage(topic, encode(message), qos=1, retain=True)


def state(core: AgentCore, *, observe_only: bool, now_ns: int, now_mono_ns: int) -> OutMessage:
    """The node's retained state: every GPU's caps in force and why."""
    decision = core.decision
    lease = core.tracker.current(now_mono_ns)
    gpus = []
    for target in core.last_targets:
        limit = target.power_limit_mw
        gpus.append(
            GpuCaps(
                index=target.index,
                uuid=target.uuid,
                priority_class=target.priority_class,
                sm_clock_max_mhz=target.sm_clock_max_mhz,
                power_limit_w=None if limit is None else limit / 1000.0,
                reasons=target.reasons,
                applied=not observe_only and target.index not in core.outcome_errors,
                error=core.outcome_errors.get(target.index),
            )
        )
    current = core.policy_store.current
    message = State(
        ts_ns=now_ns,
        seq=core.next_seq(),
        node=core.addr.node,
        level=decision.level if decision else 0,
        fail_safe=decision.fail_safe if decision else False,
        observe_only=observe_only,
        # Display only: the lease's end on this node's wall clock.
        lease_expires_ns=max(0, now_ns + lease.expires_mono_ns - now_mono_ns) if lease else None,
        control_seq=lease.control.seq if lease else None,
        policy_revision=current.revision if current else None,
        gpus=tuple(gpus),
    )
    topic = core.topics.node(core.addr, "state")
    return OutMessage(topic, encode(message), qos=1, retain=True)


def event(
    core: AgentCore,
    name: str,
    *,
    gpu: int | None,
    uuid: str | None,
    detail: Mapping[str, Any],
    now_ns: int | None = None,
) -> OutMessage | None:
    """One event of the node; None (logged) when its detail does not fit the wire."""
    try:
        message = Event(
            ts_ns=now_ns if now_ns is not None else core.now_ns(),
            seq=core.next_seq(),
            node=core.addr.node,
            event=name,
            gpu=gpu,
            uuid=uuid,
            detail=dict(detail),
        )
    except ValidationError as exc:
        _log.warning("event_not_published", event_name=name, error=str(exc)[:400])
        return None
    return OutMessage(core.topics.node(core.addr, "events"), encode(message), qos=1)


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


def telemetry(
    core: AgentCore,
    window: TelemetryWindow,
    *,
    applied: Mapping[int, Setting],
    interval_s: float,
    health: Health,
    now_ns: int,
    gpu_health: Mapping[int, GpuHealthReport] | None = None,
) -> tuple[Telemetry, OutMessage]:
    """One telemetry message of the node from the samples ``window`` folded, to publish;
    ``gpu_health`` are the GPUs' health counters due in it (``HealthTracker.due``)."""
    locks = {
        index: setting.sm_clocks_mhz[1] if setting.sm_clocks_mhz else None
        for index, setting in applied.items()
    }
    records, power_w, energy_j = window.drain(
        classes=dict(core.gpu_classes()), lost=set(core.lost), locks=locks, health=gpu_health
    )
    decision = core.decision
    bus = health.bus
    message = Telemetry(
        ts_ns=now_ns,
        seq=core.next_seq(),
        node=core.addr.node,
        interval_s=interval_s,
        node_gpu_power_w=power_w,
        node_energy_delta_j=energy_j,
        level=decision.level if decision else 0,
        fail_safe=decision.fail_safe if decision else False,
        gpus=tuple(records),
        health=AgentHealth(
            ticks=health.ticks,
            tick_p99_ms=health.tick_p99_ms,
            gpu_call_p99_ms=health.gpu_call_p99_ms,
            outbox_dropped=bus.outbox_dropped if bus else 0,
            inbox_dropped=bus.inbox_dropped if bus else 0,
            control_rejected=health.rejected,
            reconnects=max(0, bus.connects - 1) if bus else 0,
            gpu_errors=health.gpu_errors,
            clock_skew_s=core.skew_s,
        ),
    )
    topic = core.topics.node(core.addr, "telemetry")
    return message, OutMessage(topic, encode(message), qos=0)


def status_line(core: AgentCore) -> str:
    """systemd's ``STATUS=``: GPUs, mode, policy, clock skew, crash loop."""
    crash_loop = core.crash_loop
    decision = core.decision
    level = decision.level if decision else 0
    mode = "fail-safe" if decision and decision.fail_safe else f"level {level}"
    lost = f", {len(core.lost)} lost" if core.lost else ""
    skew = f", clock off by {core.skew_s:+.1f} s" if core.clock_skewed and core.skew_s else ""
    loop = f"; {crash_loop}" if crash_loop else ""
    current = core.policy_store.current
    revision = current.revision if current else "none"
    return f"{len(core.infos)} GPUs{lost}, {mode}, policy {revision}{skew}{loop}"
