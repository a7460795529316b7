"""The agent's points for its own ``/metrics`` (pure): what it reads, decides and suffers.

Built once per telemetry interval from the message just published and a snapshot of the
core (``messages.NodeSnapshot``), then handed to the agent's sinks (``polca.export``: the
Prometheus sink). The GPU readings and health counters go through the same builders as on
the aggregator (``polca.export.gpus``), so both paths name every series alike; ``gpu_cap``
(the caps in force and the policy source that won each) and ``agent`` (level, lease,
fail-safe, observe, error and drop counters) are the agent's own. No I/O, and no import of
the core.
"""

from __future__ import annotations

from collections.abc import Mapping

from polca.agent.control import Lease
from polca.agent.messages import NodeSnapshot
from polca.export.gpus import gpu_health_points, gpu_points, gpu_workload_points
from polca.export.points import AnyPoint, make_point
from polca.telemetry.schema import GpuHealthReport, Telemetry


def agent_points(
    snapshot: NodeSnapshot,
    message: Telemetry,
    *,
    lease: Lease | None,
    site: str,
    health: Mapping[int, GpuHealthReport],
    gpu_errors: int,
    now_mono_ns: int,
) -> list[AnyPoint]:
    """Every point of one interval: GPUs, their health and caps, and the agent itself.

    ``lease`` is the control lease in force at ``now_mono_ns`` (None: none).
    """
    addr = snapshot.addr
    out: list[AnyPoint] = list(gpu_points(message, site=site, row=addr.row, rack=addr.rack))
    out.extend(gpu_health_points(message, site=site, row=addr.row, rack=addr.rack, health=health))
    out.extend(gpu_workload_points(message, site=site, row=addr.row, rack=addr.rack))
    ts_ns = message.ts_ns
    node_tags = {"site": site, "row": addr.row, "rack": addr.rack, "node": addr.node}
    for target in snapshot.targets:
        limit_mw = target.power_limit_mw
        out.append(
            make_point(
                "gpu_cap",
                ts_ns=ts_ns,
                tags={
                    **node_tags,
                    "gpu_uuid": target.uuid,
                    "gpu_index": str(target.index),
                    "class": target.priority_class,
                    "clock_reason": target.sm_clock_reason or "none",
                    "power_reason": target.power_limit_reason or "none",
                },
                fields={
                    "sm_clock_max_mhz": target.sm_clock_max_mhz,
                    "power_limit_w": None if limit_mw is None else limit_mw / 1000.0,
                    "applied": snapshot.applied(target.index),
                },
            )
        )
    h = message.health
    out.append(
        make_point(
            "agent",
            ts_ns=ts_ns,
            tags=node_tags,
            fields={
                "level": message.level,
                "fail_safe": message.fail_safe,
                "observe": snapshot.observe_only,
                # An expired lease reads 0 (not absent), so "expiring" can be alerted on.
                "lease_remaining_s": (
                    max(0.0, (lease.expires_mono_ns - now_mono_ns) / 1e9) if lease else None
                ),
                "lease_s": (
                    (lease.control.lease_expires_ns - lease.control.issued_ns) / 1e9
                    if lease
                    else None
                ),
                "gpus": snapshot.gpu_count,
                "gpus_lost": len(snapshot.lost),
                "tick_p99_ms": h.tick_p99_ms,
                "clock_skew_s": h.clock_skew_s,
                "gpu_errors": gpu_errors,
                "outbox_dropped": h.outbox_dropped,
                "inbox_dropped": h.inbox_dropped,
                "control_rejected": h.control_rejected,
                "reconnects": h.reconnects,
                "ticks": h.ticks,
            },
        )
    )
    return out
