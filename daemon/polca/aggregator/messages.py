"""The messages an aggregator publishes, built from a control step's results (pure).

Leased control per scope (retained, QoS 1), the row summary ``polca status`` shows
(retained), each cooling loop's state (retained) and alarm events (QoS 1), the node policy
bundle per row (retained), the aggregator's own status and audit events. Topics come from
``Topics``; stamps come in as arguments; nothing here publishes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import structlog
from pydantic import ValidationError

from polca import __version__
from polca.aggregator.step import RowResult, Scope, StepResult
from polca.cooling.alarms import AlarmEvent
from polca.cooling.supervisor import LoopAssessment
from polca.policy import LoadedPolicy
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import (
    MAX_PAYLOAD_BYTES,
    ClassPower,
    CoolingAlarm,
    CoolingLoopState,
    Event,
    LoopAlarm,
    PolicyBundle,
    RackSummary,
    RowSummary,
    Status,
    encode,
)
from polca.telemetry.topics import Topics

_log = structlog.get_logger()


def control(topics: Topics, site: str, scope: Scope, payload: bytes) -> OutMessage:
    """A scope's retained control message (``payload``: the encoded ``Control``)."""
    row, rack = scope
    topic = topics.row_control(site, row) if rack is None else topics.rack_control(site, row, rack)
    return OutMessage(topic, payload, qos=1, retain=True)


def step_messages(
    topics: Topics, *, site: str, issuer: str, result: StepResult
) -> Iterator[OutMessage]:
    """Everything one step publishes, in order: cooling alarms and loop states, then per
    row the changes of its meter's standing (audit events), its scopes' control and its
    summary."""
    now_ns = result.now_ns
    for alarm_event in result.cooling.events:
        yield alarm(topics, site=site, event=alarm_event, now_ns=now_ns)
    for name, loop in result.cooling.loops.items():
        yield loop_state(topics, site=site, name=name, loop=loop, now_ns=now_ns)
    for row in result.rows:
        for change in row.rollup.meter_changes:
            message = event(
                topics,
                site=site,
                instance=issuer,
                name=change.event,
                detail={"row": row.spec.name, **change.fields},
                now_ns=now_ns,
            )
            if message is not None:
                yield message
        yield control(topics, site, (row.spec.name, None), encode(row.decision.control))
        for rack, decision in row.rack_decisions.items():
            yield control(topics, site, (row.spec.name, rack), encode(decision.control))
        yield summary(topics, site=site, issuer=issuer, row=row, now_ns=now_ns)


def alarm(topics: Topics, *, site: str, event: AlarmEvent, now_ns: int) -> OutMessage:
    """One cooling alarm raised, escalated, de-escalated or cleared (QoS 1)."""
    message = CoolingAlarm(
        ts_ns=now_ns,
        loop=event.loop,
        alarm=event.alarm,
        severity=event.severity,
        action=event.action,
        previous=event.previous,
        value=event.value,
        threshold=event.threshold,
        text=event.text[:512],
    )
    return OutMessage(topics.loop_alarms(site, event.loop), encode(message), qos=1)


def loop_state(
    topics: Topics, *, site: str, name: str, loop: LoopAssessment, now_ns: int
) -> OutMessage:
    """A cooling loop as the aggregator sees it (retained)."""
    message = CoolingLoopState(
        ts_ns=now_ns,
        loop=name,
        cdu=loop.cdu,
        racks=loop.racks,
        heat_load_kw=loop.heat_load_kw,
        heat_removed_kw=loop.heat_removed_kw,
        capacity_kw=loop.capacity_kw,
        headroom_kw=loop.headroom_kw,
        supply_temp_c=loop.supply_temp_c,
        return_temp_c=loop.return_temp_c,
        flow_lpm=loop.flow_lpm,
        flow_fraction=loop.flow_fraction,
        thermal_budget_w=loop.thermal_budget_w,
        severity=loop.worst_severity or "ok",
        alarms=tuple(LoopAlarm(alarm=a.alarm, severity=a.severity) for a in loop.alarms),
        emergency=loop.emergency,
        stale=loop.stale,
        forced_levels=dict(loop.forced_levels),
    )
    return OutMessage(topics.loop_state(site, name), encode(message), qos=1, retain=True)


def summary(topics: Topics, *, site: str, issuer: str, row: RowResult, now_ns: int) -> OutMessage:
    """The row as the aggregator sees it, for ``polca status`` (retained)."""
    rollup, decision, budgets = row.rollup, row.decision, row.budgets
    message = RowSummary(
        ts_ns=now_ns,
        row=rollup.row,
        issuer=issuer,
        power_w=rollup.power_w,
        power_source=rollup.power_source,
        power_note=rollup.power_note[:512],
        budget_w=rollup.budget_w,
        effective_budget_w=budgets.row_w,
        electrical_budget_w=row.electrical.budget_w,
        budget_origin=row.electrical.origin,
        budget_limited_by=row.electrical.limited_by,
        leased_budget_w=row.electrical.leased_w,
        feeds=dict(row.electrical.feeds),
        floor_w=row.demand.floor_w,
        power_by_class=tuple(
            ClassPower(priority_class=cls, power_w=power_w)
            for cls, power_w in row.demand.power_by_class_w
        ),
        level=decision.level,
        level_name=decision.level_name,
        thresholds_w=decision.thresholds_w,
        trend_w_per_s=row.trend_w_per_s,
        lease_expires_ns=decision.control.lease_expires_ns,
        observe=decision.control.observe,
        racks=tuple(
            RackSummary(
                rack=r.rack,
                power_w=r.power_w,
                budget_w=budgets.racks.get(r.rack),
                thermal_budget_w=budgets.thermal.get(r.rack),
                level=budgets.rack_levels.get(r.rack, 0),
                nodes_online=r.nodes_online,
                nodes_stale=r.nodes_stale,
                nodes_offline=r.nodes_offline,
            )
            for r in rollup.racks
        ),
        offline_nodes=rollup.offline_nodes,
        stale_nodes=rollup.stale_nodes,
        implausible_nodes=rollup.implausible_nodes,
    )
    topic = topics.row_summary(site, rollup.row)
    return OutMessage(topic, _within_wire(message), qos=0, retain=True)


def _within_wire(message: RowSummary) -> bytes:
    """The summary encoded within ``MAX_PAYLOAD_BYTES``: a row of thousands of nodes with
    long names, most of them offline, would not fit (and the broker would drop the
    connection that sent it), so its node lists, then its racks, are halved until it
    does, and it says so (``truncated``)."""
    payload = encode(message)
    lists = ("offline_nodes", "stale_nodes", "implausible_nodes", "racks")
    while len(payload) > MAX_PAYLOAD_BYTES:
        longest = max(lists, key=lambda name: len(getattr(message, name)))
        kept = getattr(message, longest)
        message = message.model_copy(update={longest: kept[: len(kept) // 2], "truncated": True})
        payload = encode(message)
    return payload


def policy_bundles(
    topics: Topics, *, site: str, rows: list[str], loaded: LoadedPolicy, now_ns: int
) -> list[OutMessage]:
    """The node policy, retained on every owned row's ``policy`` topic."""
    bundle = PolicyBundle(
        ts_ns=now_ns,
        name=loaded.policy.name,
        revision=loaded.revision,
        text=loaded.text,
        source=loaded.source[-512:],  # the wire bound; the end of a path says most
    )
    payload = encode(bundle)
    return [OutMessage(topics.policy(site, row), payload, qos=1, retain=True) for row in rows]


def status(
    topics: Topics,
    *,
    site: str,
    instance: str,
    state: str,
    loaded: LoadedPolicy | None,
    started_ns: int,
    now_ns: int,
    reason: str | None = None,
    crash_loop: str | None = None,
    ha: Mapping[str, Any] | None = None,
    mqtt_endpoint: str | None = None,
) -> OutMessage:
    """The aggregator's retained status (its Last Will says ``offline``); ``ha``: its
    shard, role, term and the leader it knows, when elected on etcd."""
    message = Status(
        **(ha or {}),
        ts_ns=now_ns,
        state=state,
        node=instance,
        agent_version=__version__,
        backend="aggregator",
        policy_name=loaded.policy.name if loaded else None,
        policy_revision=loaded.revision if loaded else None,
        started_ns=started_ns,
        reason=reason if reason is not None or state == "offline" else crash_loop,
        mqtt_endpoint=mqtt_endpoint,
    )
    return OutMessage(
        topics.aggregator(site, instance, "status"), encode(message), qos=1, retain=True
    )


def event(
    topics: Topics, *, site: str, instance: str, name: str, detail: Mapping[str, Any], now_ns: int
) -> OutMessage | None:
    """One audit event of the aggregator; None (logged) when it does not fit the wire."""
    try:
        message = Event(ts_ns=now_ns, seq=0, node=instance, event=name, detail=dict(detail))
    except ValidationError as exc:
        _log.warning("event_not_published", event_name=name, error=str(exc)[:400])
        return None
    return OutMessage(topics.aggregator(site, instance, "events"), encode(message), qos=1)
