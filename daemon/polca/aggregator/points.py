"""The points of the aggregator, built from what it decided and received (pure).

The one place where the aggregator's typed results (a ``StepResult`` of the control step,
the telemetry and events the intake accepted, the cooling assessments) become points of
``polca.export.schema.SCHEMA``; ``core.py`` picks the ones due (``export.schedule.Thinning``)
and the shell (``runtime.py``) hands them to the sinks. No I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from polca.aggregator.witness import TrustChange
from polca.bmc.actuator import OobOutcome
from polca.cooling.alarms import AlarmEvent
from polca.cooling.loops import severity_rank
from polca.cooling.supervisor import LoopAssessment
from polca.export.points import FieldValue, Point, make_point
from polca.telemetry.schema import Control, Event

if TYPE_CHECKING:
    from polca.aggregator.controller import ScopeDecision
    from polca.aggregator.intake import Intake
    from polca.aggregator.step import RowResult, StepResult
    from polca.export.sink import SinkStats

_TEXT_MAX_CHARS: Final = 256
"""An event's text field, in characters."""


def node_point(
    *, ts_ns: int, site: str, row: str, rack: str, node: str, **fields: FieldValue | None
) -> Point:
    """A ``node`` point (the rollup supplies the fields; see ``SCHEMA["node"]``)."""
    tags = {"site": site, "row": row, "rack": rack, "node": node}
    return make_point("node", ts_ns=ts_ns, tags=tags, fields=fields)


def rack_point(*, ts_ns: int, site: str, row: str, rack: str, **fields: FieldValue | None) -> Point:
    """A ``rack`` point (see ``SCHEMA["rack"]``)."""
    return make_point(
        "rack", ts_ns=ts_ns, tags={"site": site, "row": row, "rack": rack}, fields=fields
    )


def row_point(*, ts_ns: int, site: str, row: str, **fields: FieldValue | None) -> Point:
    """A ``row`` point (see ``SCHEMA["row"]``)."""
    return make_point("row", ts_ns=ts_ns, tags={"site": site, "row": row}, fields=fields)


def control_point(
    *, ts_ns: int, site: str, row: str, scope: str, **fields: FieldValue | None
) -> Point:
    """A ``control`` point: ``scope`` is ``row``, or ``rack:<rack>`` for a rack-scope decision."""
    return make_point(
        "control", ts_ns=ts_ns, tags={"site": site, "row": row, "scope": scope}, fields=fields
    )


def control_point_from(control: Control, *, site: str, brakes: int | None = None) -> Point:
    """The ``control`` point of a published control message (lease length in seconds);
    ``brakes`` counts the scope's entries into the top level since the controller started."""
    scope = "row" if control.scope == "row" else f"rack:{control.rack}"
    return control_point(
        ts_ns=control.issued_ns,
        site=site,
        row=control.row,
        scope=scope,
        level=control.level,
        seq=control.seq,
        brakes=brakes,
        lease_s=(control.lease_expires_ns - control.issued_ns) / 1e9,
        observe=control.observe,
        level_name=control.level_name,
        reason=control.reason,
    )


NODE_EVENT_KINDS: Final[frozenset[str]] = frozenset(
    {
        "cap_changed",
        "cap_failed",
        "cap_reasserted",
        "clock_skew_cleared",
        "clock_skew_detected",
        "fail_safe_entered",
        "fail_safe_left",
        "gpu_lost",
        "gpu_recovered",
        "gpu_xid",
        "policy_applied",
        "policy_rejected",
    }
)
"""The event names polca's agent publishes (``AgentCore.event``): the only ``kind`` tags a
node's event gets.

Why: a tag value is a series, and a node's credentials let it publish any schema-valid name;
each new one would be a new series in the database (and an annotation that looks like
polca's own). Any other name becomes ``OTHER_EVENT_KIND``, the name kept in the fields.
``tests/aggregator/test_points_events.py`` fails when the agent publishes a name not here.
The aggregator's own ``level_changed`` points have their own builder
(``level_changed_point``); a node cannot claim that kind."""

OTHER_EVENT_KIND: Final = "other"
"""The ``kind`` of a node's event whose name is not in ``NODE_EVENT_KINDS``."""

_UNKNOWN_NAME_MAX_CHARS: Final = 64
"""An unknown event name in an event's text, in characters (the wire allows 128)."""
_NAME_MAX_CHARS: Final = 128
"""An unknown event name in an event's detail (``event``), in characters (the wire's bound)."""


def event_point(event: Event, *, site: str, row: str, rack: str) -> Point:
    """An ``event`` point: ``text`` is a one-line summary for annotations, ``detail`` JSON.

    ``kind`` is the event's name when polca's agent publishes it (``NODE_EVENT_KINDS``), else
    ``other``: then the name is in ``text`` (cut to 64 characters) and in ``detail`` as
    ``event`` (cut to 128), never in a tag.
    """
    name = event.event
    detail = dict(event.detail)
    if event.uuid is not None:
        detail.setdefault("uuid", event.uuid)
    if name in NODE_EVENT_KINDS:
        kind = name
    else:
        kind = OTHER_EVENT_KIND
        detail["event"] = name[:_NAME_MAX_CHARS]  # over any "event" key the node sent
        if len(name) > _UNKNOWN_NAME_MAX_CHARS:
            name = name[: _UNKNOWN_NAME_MAX_CHARS - 1] + "…"
    text = f"{event.node}: {name}"
    if event.gpu is not None:
        text += f" gpu {event.gpu}"
    scalars = [
        f"{key}={value}"
        for key, value in sorted(event.detail.items())
        if isinstance(value, str | int | float | bool) or value is None
    ]
    if scalars:
        text += ": " + ", ".join(scalars)
    if len(text) > _TEXT_MAX_CHARS:
        text = text[: _TEXT_MAX_CHARS - 1] + "…"
    return make_point(
        "event",
        ts_ns=event.ts_ns,
        tags={"site": site, "row": row, "rack": rack, "node": event.node, "kind": kind},
        fields={
            "text": text,
            "gpu": event.gpu,
            "detail": json.dumps(detail, sort_keys=True, separators=(",", ":"), default=str),
        },
    )


def aggregator_point(
    *,
    ts_ns: int,
    site: str,
    instance: str,
    dropped: Mapping[str, int] | None = None,
    implausible: Mapping[str, int] | None = None,
    **fields: FieldValue | None,
) -> Point:
    """An ``aggregator`` health point; ``dropped`` maps a reason to its ``dropped_<reason>``,
    ``implausible`` to its ``implausible_<reason>``."""
    all_fields: dict[str, FieldValue | None] = dict(fields)
    for reason, count in (dropped or {}).items():
        all_fields[f"dropped_{reason}"] = count
    for reason, count in (implausible or {}).items():
        all_fields[f"implausible_{reason}"] = count
    return make_point(
        "aggregator",
        ts_ns=ts_ns,
        tags={"site": site, "instance": instance},
        fields=all_fields,
    )


def leader_point(
    *,
    ts_ns: int,
    site: str,
    instance: str,
    shard: str,
    role: str,
    term: int,
    leader: str | None,
    leader_term: int,
) -> Point:
    """A ``leadership`` point: one instance's view when its shard's leadership changed
    (an annotation on the dashboards)."""
    return make_point(
        "leadership",
        ts_ns=ts_ns,
        tags={"site": site, "shard": shard, "instance": instance},
        fields={
            "term": term,
            "leader_term": leader_term,
            "leading": 1.0 if role == "leader" else 0.0,
            "leader": leader,
        },
    )


def oob_point(
    outcome: OobOutcome, *, ts_ns: int, site: str, capped: bool, counts: Mapping[str, int]
) -> Point:
    """An ``oob`` point: one out-of-band write through a node's BMC, as it ended, with the
    node's running counts of verified caps, verified releases and failed writes."""
    return make_point(
        "oob",
        ts_ns=ts_ns,
        tags={"site": site, "node": outcome.node},
        fields={
            "action": outcome.action,
            "reason": outcome.reason,
            "error": outcome.error,
            "target_w": outcome.target_w,
            "limit_w": outcome.limit_w,
            "verified": 1.0 if outcome.verified else 0.0,
            "capped": 1.0 if capped else 0.0,
            "latency_s": outcome.latency_s,
            "caps": counts.get("caps", 0),
            "releases": counts.get("releases", 0),
            "failures": counts.get("failures", 0),
        },
    )


def cooling_loop_point(loop: LoopAssessment, *, ts_ns: int, site: str) -> Point:
    """A ``cooling_loop`` point: one loop's assessment at one control interval.

    ``derate_fraction`` is the capacity's derating, ``severity`` the worst active alarm
    (0 none, 1 warning, 2 degraded, 3 critical), ``alarms`` how many are active,
    ``pumps_failed`` and ``leaks`` counts, ``emergency`` and ``stale`` flags (0/1).
    Readings the CDU does not report, or not while stale, are left out.
    """
    return make_point(
        "cooling_loop",
        ts_ns=ts_ns,
        tags={"site": site, "loop": loop.loop, "cdu": loop.cdu},
        fields={
            "heat_load_kw": loop.heat_load_kw,
            "heat_removed_kw": loop.heat_removed_kw,
            "heat_balance_error_pct": loop.heat_balance_error_pct,
            "rated_capacity_kw": loop.rated_capacity_kw,
            "capacity_kw": loop.capacity_kw,
            "headroom_kw": loop.headroom_kw,
            "load_pct": loop.load_pct,
            "derate_fraction": loop.derate.total,
            "supply_temp_c": loop.supply_temp_c,
            "return_temp_c": loop.return_temp_c,
            "delta_t_c": loop.delta_t_c,
            "flow_lpm": loop.flow_lpm,
            "flow_fraction": loop.flow_fraction,
            "pumps_available": loop.pumps_available,
            "pumps_failed": len(loop.pumps_failed),
            "leaks": len(loop.leaks),
            "thermal_budget_w": loop.thermal_budget_w,
            "forced_level": loop.forced_level,
            "severity": severity_rank(loop.worst_severity),
            "alarms": len(loop.alarms),
            "emergency": loop.emergency,
            "stale": loop.stale,
            "telemetry_age_s": loop.telemetry_age_s,
        },
    )


def cooling_alarm_point(event: AlarmEvent, *, ts_ns: int, site: str) -> Point:
    """A ``cooling_alarm`` point: one alarm raised, escalated, de-escalated or cleared.

    ``rank`` is the severity's (1 warning, 2 degraded, 3 critical), ``previous_severity``
    the one before the change (left out when it was raised), ``text`` one line for the
    dashboards' annotations.
    """
    return make_point(
        "cooling_alarm",
        ts_ns=ts_ns,
        tags={
            "site": site,
            "loop": event.loop,
            "alarm": event.alarm,
            "severity": event.severity,
            "action": event.action,
        },
        fields={
            "value": event.value,
            "threshold": event.threshold,
            "rank": severity_rank(event.severity),
            "previous_severity": event.previous,
            "text": event.text,
            "detail": event.detail,
        },
    )


# --- one control step --------------------------------------------------------------------


def step_points(result: StepResult, *, site: str, instance: str) -> list[Point]:
    """Every point of one control step: cooling, each row and its racks, nodes and control,
    and an ``event`` point for every scope whose level changed."""
    now_ns = result.now_ns
    out = [cooling_alarm_point(e, ts_ns=now_ns, site=site) for e in result.cooling.events]
    out.extend(
        cooling_loop_point(loop, ts_ns=now_ns, site=site) for loop in result.cooling.loops.values()
    )
    for row in result.rows:
        out.extend(_row_points(row, now_ns=now_ns, site=site))
    for (row_name, rack), decision in result.decisions():
        if decision.changed:
            out.append(
                level_changed_point(
                    decision, site=site, row=row_name, rack=rack, instance=instance, ts_ns=now_ns
                )
            )
    return out


def level_changed_point(
    decision: ScopeDecision, *, site: str, row: str, rack: str | None, instance: str, ts_ns: int
) -> Point:
    """The audit record of a level change, as a dashboard annotation."""
    return make_point(
        "event",
        ts_ns=ts_ns,
        tags={
            "site": site,
            "row": row,
            "rack": rack or "",
            "node": instance,
            "kind": "level_changed",
        },
        fields={
            "text": f"{decision.level_name}: {decision.control.reason}",
            "detail": json.dumps(decision.audit, sort_keys=True),
        },
    )


def _meter_text(change: TrustChange) -> str:
    """A meter standing change as an annotation's text."""
    f = change.fields
    if change.event == "meter_distrusted":
        return f"meter distrusted ({f['reason']}): {f['reading_w']} W, bound {f['bound_w']} W"
    return f"meter trusted again after {f['distrusted_s']} s ({f['refused_readings']} refused)"


def _row_points(row: RowResult, *, now_ns: int, site: str) -> list[Point]:
    rollup, decision, budgets = row.rollup, row.decision, row.budgets
    electrical = row.electrical
    thresholds = {f"threshold_{i + 1}_w": t for i, t in enumerate(decision.thresholds_w[:3])}
    out = [
        row_point(
            ts_ns=now_ns,
            site=site,
            row=rollup.row,
            power_w=rollup.power_w,
            computed_power_w=rollup.computed_power_w,
            measured_power_w=rollup.measured_power_w,
            budget_w=rollup.budget_w,
            effective_budget_w=budgets.row_w,
            power_pct=decision.power_pct,
            level=float(decision.level),
            trend_w_per_s=row.trend_w_per_s,
            nodes_online=float(len(rollup.fresh_nodes)),
            nodes_stale=float(len(rollup.stale_nodes)),
            nodes_offline=float(len(rollup.offline_nodes)),
            meter_trusted=None if rollup.meter_trusted is None else float(rollup.meter_trusted),
            meter_refusals=rollup.meter_refusals if rollup.meter_trusted is not None else None,
            electrical_budget_w=electrical.budget_w,
            budget_origin=electrical.origin,
            budget_limited_by=electrical.limited_by,
            leased_budget_w=electrical.leased_w,
            on_fallback=1.0 if electrical.origin == "fallback" else 0.0,
            **thresholds,
        ),
        control_point_from(decision.control, site=site, brakes=decision.brakes),
    ]
    out.extend(
        make_point(
            "event",
            ts_ns=now_ns,
            tags={"site": site, "row": rollup.row, "rack": "", "node": "", "kind": change.event},
            fields={
                "text": _meter_text(change),
                "detail": json.dumps(change.fields, sort_keys=True),
            },
        )
        for change in rollup.meter_changes
    )
    out.extend(
        control_point_from(d.control, site=site, brakes=d.brakes)
        for d in row.rack_decisions.values()
    )
    for rack in rollup.racks:
        out.append(
            rack_point(
                ts_ns=now_ns,
                site=site,
                row=rollup.row,
                rack=rack.rack,
                power_w=rack.power_w,
                budget_w=budgets.racks.get(rack.rack),
                thermal_budget_w=budgets.thermal.get(rack.rack),
                nodes_online=float(rack.nodes_online),
                nodes_stale=float(rack.nodes_stale),
                nodes_offline=float(rack.nodes_offline),
            )
        )
    for node in row.nodes:
        t = node.telemetry
        fresh = t is not None and node.health == "fresh"
        out.append(
            node_point(
                ts_ns=now_ns,
                site=site,
                row=rollup.row,
                rack=node.rack,
                node=node.node,
                gpu_power_w=t.node_gpu_power_w if t and fresh else None,
                power_w=node.power_w,
                energy_delta_j=t.node_energy_delta_j if t and fresh else None,
                level=float(t.level) if t else None,
                fail_safe=float(t.fail_safe) if t else None,
                online=float(node.health == "fresh"),
                stale=float(node.health == "stale"),
                gpus=float(len(t.gpus)) if t else None,
                gpus_lost=float(sum(1 for g in t.gpus if g.state == "lost")) if t else None,
                tick_p99_ms=t.health.tick_p99_ms if t else None,
                outbox_dropped=t.health.outbox_dropped if t else None,
                control_rejected=t.health.control_rejected if t else None,
                gpu_errors=t.health.gpu_errors if t else None,
                implausible=float(node.implausible),
                implausible_readings=node.implausible_readings,
                rate_limited=node.rate_limited,
                quarantined=float(node.quarantined),
                quarantine_releases=node.quarantine_releases,
            )
        )
    return out


def aggregator_point_of(
    intake: Intake,
    stats: SinkStats,
    *,
    site: str,
    instance: str,
    ts_ns: int,
    step_failures: int = 0,
) -> Point:
    """The aggregator's own health: messages in and dropped by reason, implausible
    telemetry by reason, failed control steps, the sinks' counters."""
    return aggregator_point(
        ts_ns=ts_ns,
        site=site,
        instance=instance,
        messages_in=intake.messages_in,
        messages_dropped=intake.drops.total,
        points_written=stats.points_written,
        points_dropped=stats.points_dropped,
        points_spooled=stats.points_spooled,
        spool_bytes=stats.spool_bytes,
        control_step_failures=step_failures,
        dropped=dict(intake.dropped),
        implausible=dict(intake.implausible),
    )
