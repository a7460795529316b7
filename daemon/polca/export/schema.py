"""THE schema polca exports to InfluxDB (and compatible stores): measurements, tags, fields.

Why this module exists: the sink, the dashboards and ``docs/influxdb.md`` must agree on
measurement, tag and field names and on each field's type. ``SCHEMA`` is that agreement;
the point builders (``points.make_point``, ``points.LineTemplate``) coerce every value to
the type it declares (a field written once as an integer and later as a float is a *field
type conflict* that InfluxDB rejects), and refuse names it does not know. A test checks
the documentation table against ``SCHEMA``.

Conventions: measured values are always floats (``250.0``, never ``250``); only counters and
bitmasks are integers (``i`` suffix in line protocol); flags are floats 0/1 so that they can
be averaged and graphed; strings only where a human reads them (events, decision reasons).
Tags hold only what is grouped or filtered on: never free text, job ids or values.

The measurements also come in two classes, what a sink keeps first under pressure
(``ESSENTIAL_MEASUREMENTS``) and what it evicts first (``BULK_MEASUREMENTS``).

Data only: no encoding (``points.py``), no I/O.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Final

__all__ = [
    "BULK_MEASUREMENTS",
    "ESSENTIAL_MEASUREMENTS",
    "SCHEMA",
    "FieldType",
    "MeasurementSchema",
]

FieldType = type[float] | type[int] | type[str]

_REASON: Final = re.compile(r"^[a-z0-9_]+$")


@dataclasses.dataclass(frozen=True, slots=True)
class MeasurementSchema:
    """The tags and typed fields of one measurement.

    A field named ``prefix_<reason>`` stands for a family of fields (``dropped_malformed``,
    ``dropped_oversized``, ...), each of that type.
    """

    tags: tuple[str, ...]
    fields: Mapping[str, FieldType]

    def field_type(self, name: str) -> FieldType | None:
        """The declared type of a field name, or None when the schema has no such field."""
        declared = self.fields.get(name)
        if declared is not None:
            return declared
        for pattern, kind in self.fields.items():
            if pattern.endswith("<reason>"):
                prefix = pattern.removesuffix("<reason>")
                reason = name.removeprefix(prefix)
                if name.startswith(prefix) and _REASON.match(reason):
                    return kind
        return None


def _floats(*names: str) -> dict[str, FieldType]:
    return dict.fromkeys(names, float)


def _ints(*names: str) -> dict[str, FieldType]:
    return dict.fromkeys(names, int)


SCHEMA: Final[Mapping[str, MeasurementSchema]] = {
    "gpu": MeasurementSchema(
        tags=("site", "row", "rack", "node", "gpu_uuid", "gpu_index", "model", "class"),
        fields={
            **_floats(
                "power_w",
                "power_max_w",
                "power_avg_w",
                "energy_j",
                "energy_delta_j",
                "temp_c",
                "temp_max_c",
                "mem_temp_c",
                "sm_clock_mhz",
                "mem_clock_mhz",
                "util_pct",
                "mem_util_pct",
                "power_limit_w",
                "enforced_power_limit_w",
                "locked_sm_clock_max_mhz",
            ),
            "clock_event_reasons": int,
            "lost": float,
        },
    ),
    "gpu_health": MeasurementSchema(
        tags=("site", "row", "rack", "node", "gpu_uuid", "gpu_index", "model"),
        fields={
            **_ints(
                "xid_errors",
                "last_xid",
                "ecc_corrected_volatile",
                "ecc_uncorrected_volatile",
                "ecc_corrected_aggregate",
                "ecc_uncorrected_aggregate",
                "retired_pages_sbe",
                "retired_pages_dbe",
            ),
            "retired_pages_pending": float,
            **_ints("remapped_rows_correctable", "remapped_rows_uncorrectable"),
            "row_remap_pending": float,
            "row_remap_failure": float,
            "pcie_replays": int,
            **_floats("power_brake_s", "hw_thermal_slowdown_s", "sw_thermal_slowdown_s"),
        },
    ),
    "gpu_cap": MeasurementSchema(
        tags=(
            "site",
            "row",
            "rack",
            "node",
            "gpu_uuid",
            "gpu_index",
            "class",
            "clock_reason",
            "power_reason",
        ),
        fields=_floats("sm_clock_max_mhz", "power_limit_w", "applied"),
    ),
    "gpu_workload": MeasurementSchema(
        tags=(
            "site",
            "row",
            "rack",
            "node",
            "gpu_uuid",
            "gpu_index",
            "class",
            "class_origin",
            "namespace",
            "pod",
            "container",
        ),
        fields=_floats("assigned"),
    ),
    "agent": MeasurementSchema(
        tags=("site", "row", "rack", "node"),
        fields={
            **_floats(
                "level",
                "fail_safe",
                "observe",
                "lease_remaining_s",
                "lease_s",
                "gpus",
                "gpus_lost",
                "tick_p99_ms",
                "clock_skew_s",
            ),
            **_ints(
                "gpu_errors",
                "outbox_dropped",
                "inbox_dropped",
                "control_rejected",
                "reconnects",
                "ticks",
            ),
        },
    ),
    "node": MeasurementSchema(
        tags=("site", "row", "rack", "node"),
        fields={
            **_floats(
                "gpu_power_w",
                "power_w",
                "energy_delta_j",
                "level",
                "fail_safe",
                "online",
                "stale",
                "gpus",
                "gpus_lost",
                "tick_p99_ms",
                "implausible",
                "quarantined",
            ),
            **_ints(
                "outbox_dropped",
                "control_rejected",
                "gpu_errors",
                "implausible_readings",
                "rate_limited",
                "quarantine_releases",
            ),
        },
    ),
    "rack": MeasurementSchema(
        tags=("site", "row", "rack"),
        fields=_floats(
            "power_w",
            "budget_w",
            "thermal_budget_w",
            "nodes_online",
            "nodes_stale",
            "nodes_offline",
        ),
    ),
    "row": MeasurementSchema(
        tags=("site", "row"),
        fields=_floats(
            "power_w",
            "computed_power_w",
            "measured_power_w",
            "budget_w",
            "effective_budget_w",
            "power_pct",
            "level",
            "threshold_1_w",
            "threshold_2_w",
            "threshold_3_w",
            "trend_w_per_s",
            "nodes_online",
            "nodes_stale",
            "nodes_offline",
            "meter_trusted",
            "electrical_budget_w",
            "leased_budget_w",
            "on_fallback",
        )
        | {"meter_refusals": int, "budget_origin": str, "budget_limited_by": str},
    ),
    "control": MeasurementSchema(
        tags=("site", "row", "scope"),
        fields={
            "level": float,
            "seq": int,
            "brakes": int,
            "lease_s": float,
            "observe": float,
            "level_name": str,
            "reason": str,
        },
    ),
    "event": MeasurementSchema(
        tags=("site", "row", "rack", "node", "kind"),
        fields={"text": str, "gpu": float, "detail": str},
    ),
    "aggregator": MeasurementSchema(
        tags=("site", "instance"),
        fields=_ints(
            "messages_in",
            "messages_dropped",
            "points_written",
            "points_dropped",
            "points_spooled",
            "spool_bytes",
            "control_step_failures",
            "dropped_<reason>",
            "implausible_<reason>",
        ),
    ),
    "mqtt": MeasurementSchema(
        tags=("site", "role", "name", "connection", "endpoint"),
        fields={"connected": float, "connects": int, "failovers": int, "disconnects": int},
    ),
    "leadership": MeasurementSchema(
        tags=("site", "shard", "instance"),
        fields={"term": int, "leader_term": int, "leading": float, "leader": str},
    ),
    "oob": MeasurementSchema(
        tags=("site", "node"),
        fields={
            "action": str,
            "reason": str,
            "error": str,
            "target_w": float,
            "limit_w": float,
            "verified": float,
            "capped": float,
            "latency_s": float,
            "caps": int,
            "releases": int,
            "failures": int,
        },
    ),
    "cooling_loop": MeasurementSchema(
        tags=("site", "loop", "cdu"),
        fields=_floats(
            "heat_load_kw",
            "heat_removed_kw",
            "heat_balance_error_pct",
            "rated_capacity_kw",
            "capacity_kw",
            "headroom_kw",
            "load_pct",
            "derate_fraction",
            "supply_temp_c",
            "return_temp_c",
            "delta_t_c",
            "flow_lpm",
            "flow_fraction",
            "pumps_available",
            "pumps_failed",
            "leaks",
            "thermal_budget_w",
            "forced_level",
            "severity",
            "alarms",
            "emergency",
            "stale",
            "telemetry_age_s",
        ),
    ),
    "cooling_alarm": MeasurementSchema(
        tags=("site", "loop", "alarm", "severity", "action"),
        fields={
            "value": float,
            "threshold": float,
            "rank": float,
            "previous_severity": str,
            "text": str,
            "detail": str,
        },
    ),
    "power_domain": MeasurementSchema(
        tags=("site", "domain", "kind"),
        fields=_floats(
            "capacity_w",
            "unlimited_w",
            "budget_w",
            "nominal_w",
            "measured_w",
            "rating_w",
            "limit_w",
            "on_battery",
            "feeds_up",
            "feeds_down",
        ),
    ),
    "power_feed": MeasurementSchema(
        tags=("site", "domain", "feed"),
        fields={"up": float, "rating_w": float, "dark_polls": float, "equipment": str},
    ),
    "row_budget": MeasurementSchema(
        tags=("site", "row"),
        fields={
            **_floats("budget_w", "nominal_w", "measured_w", "rating_w", "limited", "stale"),
            "limited_by": str,
        },
    ),
}
"""Measurement -> tags and typed fields. ``docs/influxdb.md`` documents exactly this."""

ESSENTIAL_MEASUREMENTS: Final[frozenset[str]] = frozenset(
    {
        "row",
        "rack",
        "node",
        "control",
        "cooling_alarm",
        "cooling_loop",
        "leadership",
        "aggregator",
        "oob",
        "mqtt",
        "power_domain",
        "power_feed",
        "row_budget",
    }
)
"""The measurements a sink must keep before any other: a sink's *essential* class.

Why: they are what the aggregator itself decided and measured, a few points per rack and
row per control step, and what operators need to reconstruct an incident (the row's power
against its budget, the level and control issued, cooling alarms, who led); and what the
site controller decided of the power tree (``power_domain``, ``power_feed``, ``row_budget``:
a few points per domain, feed and row per allocation). The *bulk*
class (``BULK_MEASUREMENTS``) is what nodes send in quantity: its size is set by the
nodes (a schema-valid telemetry message may list 1,024 GPUs, a node may publish events at
will), so under a stalled database it must never crowd the essential points out. A sink
evicts bulk points first (``influx.py``: memory and spool); essential ones are lost only
when they alone exceed the bounds. A measurement in neither set (not in ``SCHEMA``) is
bulk; a test checks that the two sets split ``SCHEMA``."""

BULK_MEASUREMENTS: Final[frozenset[str]] = frozenset(
    {"gpu", "gpu_cap", "gpu_health", "gpu_workload", "agent", "event"}
)
"""Per-GPU and per-node-report measurements whose volume the nodes control; evicted first.

``event`` is here too: a node chooses how many it publishes. The aggregator's own level
changes (``event`` points of kind ``level_changed``) are also in ``control`` points."""
