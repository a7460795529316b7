"""A Prometheus ``/metrics`` endpoint: one more sink of the export path.

Why a sink: the points the aggregator writes to InfluxDB (``schema.py``'s ``SCHEMA``) are
already every fact worth a metric; this sink keeps the latest value of every series and
serves them in Prometheus's text format (``prometheus-client``), renamed to Prometheus's
conventions: base units (``_watts``, ``_joules_total``, ``_celsius``, ``_hertz``,
``_seconds``, ratios for percentages), ``_total`` for counters, and the labels
``site, row, rack, node, gpu, uuid, class`` (others as the point has them). The catalogue
is ``FAMILIES``; the reference with cardinalities is docs/prometheus.md.

Bounded: at most ``max_series`` series are kept (a topology's worth; beyond it new series
are dropped and counted, never old ones), and a series not written for ``stale_after_s``
is left out of the scrape (a node gone quiet disappears rather than freezing at its last
value). Serving runs on prometheus-client's own HTTP thread; ``write`` is a dictionary
update on the event loop, and the scrape reads a copy under a lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from polca.export.points import AnyPoint
from polca.export.sink import SinkStats
from polca.gpu.backend import CLOCK_EVENT_NAMES
from polca.settings import MetricsSettings
from polca.telemetry.schema import BudgetOrigin

Kind = Literal["gauge", "counter"]
_LABELS: Final = {"gpu_index": "gpu", "gpu_uuid": "uuid"}
"""Point tags renamed to Prometheus labels (every other tag keeps its name)."""
_LEFT_OUT_TAGS: Final = frozenset({"model", "instance"})
"""Tags that are no metric label: the model is an attribute (not a dimension) and
``instance`` is Prometheus's own label for the scraped target."""


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family made from one field of one measurement."""

    measurement: str
    field: str
    name: str
    kind: Kind
    help: str
    scale: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()
    """Constant labels that tell this field from the family's others (``type="corrected"``)."""


def _f(measurement: str, field: str, name: str, help_text: str, **kw: Any) -> Family:
    kind: Kind = "counter" if name.endswith("_total") else "gauge"
    return Family(measurement, field, name, kind, help_text, **kw)


FAMILIES: Final[tuple[Family, ...]] = (
    # Per GPU, from the agents' telemetry.
    _f("gpu", "power_w", "polca_gpu_power_watts", "GPU power over the last interval."),
    _f("gpu", "power_max_w", "polca_gpu_power_max_watts", "Highest GPU power reading."),
    _f("gpu", "energy_j", "polca_gpu_energy_joules_total", "GPU energy counter."),
    _f("gpu", "temp_c", "polca_gpu_temperature_celsius", "GPU die temperature."),
    _f("gpu", "mem_temp_c", "polca_gpu_memory_temperature_celsius", "GPU memory temperature."),
    _f("gpu", "sm_clock_mhz", "polca_gpu_sm_clock_hertz", "SM clock.", scale=1e6),
    _f("gpu", "mem_clock_mhz", "polca_gpu_memory_clock_hertz", "Memory clock.", scale=1e6),
    _f("gpu", "util_pct", "polca_gpu_utilization_ratio", "GPU utilisation.", scale=0.01),
    _f("gpu", "power_limit_w", "polca_gpu_power_limit_watts", "Power limit set."),
    _f(
        "gpu",
        "enforced_power_limit_w",
        "polca_gpu_enforced_power_limit_watts",
        "Power limit the driver enforces.",
    ),
    _f(
        "gpu",
        "locked_sm_clock_max_mhz",
        "polca_gpu_locked_sm_clock_max_hertz",
        "Upper SM clock lock polca applied (absent when unlocked).",
        scale=1e6,
    ),
    _f("gpu", "lost", "polca_gpu_lost", "1 while the agent reports the GPU lost."),
    # Per GPU, its health counters (sent on change and every agent.health_every_s).
    _f("gpu_health", "xid_errors", "polca_gpu_xid_errors_total", "XID events since start."),
    _f("gpu_health", "last_xid", "polca_gpu_last_xid", "Code of the last XID event."),
    *(
        _f(
            "gpu_health",
            f"ecc_{kind}_{counter}",
            "polca_gpu_ecc_errors_total",
            "ECC errors (volatile: since driver load; aggregate: GPU lifetime).",
            labels=(("type", kind), ("counter", counter)),
        )
        for kind in ("corrected", "uncorrected")
        for counter in ("volatile", "aggregate")
    ),
    *(
        _f(
            "gpu_health",
            f"retired_pages_{cause}",
            "polca_gpu_retired_pages",
            "Memory pages retired, by cause (single or double bit).",
            labels=(("cause", cause),),
        )
        for cause in ("sbe", "dbe")
    ),
    _f(
        "gpu_health",
        "retired_pages_pending",
        "polca_gpu_retired_pages_pending",
        "1 while a page retirement waits for a reset.",
    ),
    *(
        _f(
            "gpu_health",
            f"remapped_rows_{kind}",
            "polca_gpu_remapped_rows",
            "Memory rows remapped, by error type.",
            labels=(("type", kind),),
        )
        for kind in ("correctable", "uncorrectable")
    ),
    _f("gpu_health", "row_remap_pending", "polca_gpu_row_remap_pending", "1: reset needed."),
    _f("gpu_health", "row_remap_failure", "polca_gpu_row_remap_failure", "1: a remap failed."),
    _f("gpu_health", "pcie_replays", "polca_gpu_pcie_replays_total", "PCIe replays."),
    *(
        _f(
            "gpu_health",
            field,
            "polca_gpu_throttle_seconds_total",
            "Time the clocks were held down, by NVML clock event reason.",
            labels=(("reason", reason),),
        )
        for field, reason in (
            ("power_brake_s", "hw_power_brake_slowdown"),
            ("hw_thermal_slowdown_s", "hw_thermal_slowdown"),
            ("sw_thermal_slowdown_s", "sw_thermal_slowdown"),
        )
    ),
    # Per GPU on the agent: the caps in force and the policy source that won each.
    _f(
        "gpu_cap",
        "sm_clock_max_mhz",
        "polca_gpu_cap_sm_clock_hertz",
        "SM clock cap polca decided (absent: none).",
        scale=1e6,
    ),
    _f("gpu_cap", "power_limit_w", "polca_gpu_cap_power_watts", "Power cap polca decided."),
    _f("gpu_cap", "applied", "polca_gpu_cap_applied", "1 when the GPU holds the caps."),
    # The agent itself.
    _f("agent", "level", "polca_agent_level", "Control level in force (0 nominal)."),
    _f("agent", "fail_safe", "polca_agent_fail_safe", "1 while the fail-safe caps apply."),
    _f("agent", "observe", "polca_agent_observe", "1 when the agent writes nothing."),
    _f(
        "agent",
        "lease_remaining_s",
        "polca_agent_lease_remaining_seconds",
        "Time left on the control lease in force (absent: no lease).",
    ),
    _f("agent", "lease_s", "polca_agent_lease_seconds", "Length of that lease when granted."),
    _f("agent", "gpus", "polca_agent_gpus", "GPUs discovered."),
    _f("agent", "gpus_lost", "polca_agent_gpus_lost", "GPUs lost now."),
    _f(
        "agent",
        "tick_p99_ms",
        "polca_agent_tick_p99_seconds",
        "Sampling tick p99 latency.",
        scale=1e-3,
    ),
    _f("agent", "clock_skew_s", "polca_agent_clock_skew_seconds", "Clock minus controller's."),
    _f("agent", "gpu_errors", "polca_agent_gpu_errors_total", "GPU library calls that failed."),
    _f(
        "agent",
        "outbox_dropped",
        "polca_agent_outbox_dropped_total",
        "Messages dropped while the broker was away.",
    ),
    _f(
        "agent",
        "inbox_dropped",
        "polca_agent_inbox_dropped_total",
        "Received messages dropped (inbox full).",
    ),
    _f(
        "agent",
        "control_rejected",
        "polca_agent_messages_rejected_total",
        "Received messages refused (bad, foreign, fenced or stale).",
    ),
    _f("agent", "reconnects", "polca_agent_reconnects_total", "Broker reconnections."),
    _f("agent", "ticks", "polca_agent_ticks_total", "Sampling ticks."),
    # Per node, from the aggregator's rollup.
    _f("node", "power_w", "polca_node_power_watts", "Node power counted in its row."),
    _f("node", "level", "polca_node_level", "Control level the agent applies."),
    _f("node", "fail_safe", "polca_node_fail_safe", "1 while the agent applies fail-safe caps."),
    _f("node", "online", "polca_node_online", "1 while the node's telemetry is fresh."),
    _f("node", "stale", "polca_node_stale", "1 while its telemetry is late."),
    _f(
        "node",
        "outbox_dropped",
        "polca_node_outbox_dropped_total",
        "Messages the agent dropped while the broker was away.",
    ),
    _f(
        "node",
        "control_rejected",
        "polca_node_control_rejected_total",
        "Control messages the agent refused.",
    ),
    _f(
        "node",
        "gpu_errors",
        "polca_node_gpu_errors_total",
        "GPU library (NVML) calls that failed on the node.",
    ),
    _f(
        "node",
        "implausible",
        "polca_node_implausible",
        "1 while the node's telemetry claims more than it can draw, or GPUs it does not have.",
    ),
    _f(
        "node",
        "implausible_readings",
        "polca_node_implausible_readings_total",
        "Implausible telemetry messages of the node (counted at its plausible bound).",
    ),
    _f(
        "node",
        "quarantined",
        "polca_node_quarantined",
        "1 while the node's topics are on a connection of their own for flooding.",
    ),
    _f(
        "node",
        "quarantine_releases",
        "polca_node_quarantine_releases_total",
        "Times the node was moved back from the quarantine connection, its flood over.",
    ),
    _f(
        "node",
        "rate_limited",
        "polca_node_messages_rate_limited_total",
        "Messages of the node the aggregator refused for exceeding its admission rate.",
    ),
    # Rack and row power against budget and thresholds.
    _f("rack", "power_w", "polca_rack_power_watts", "Rack power."),
    _f("rack", "budget_w", "polca_rack_budget_watts", "Rack power budget."),
    _f("rack", "thermal_budget_w", "polca_rack_thermal_budget_watts", "Rack thermal budget."),
    _f("row", "power_w", "polca_row_power_watts", "Row power the controller acted on."),
    _f("row", "budget_w", "polca_row_budget_watts", "Provisioned row budget."),
    _f("row", "effective_budget_w", "polca_row_effective_budget_watts", "Budget in force."),
    _f("row", "level", "polca_row_level", "Row control level (0 nominal)."),
    _f("row", "threshold_1_w", "polca_row_threshold_1_watts", "Row power of level 1."),
    _f("row", "threshold_2_w", "polca_row_threshold_2_watts", "Row power of level 2."),
    _f("row", "threshold_3_w", "polca_row_threshold_3_watts", "Row power of level 3."),
    _f("row", "nodes_stale", "polca_row_nodes_stale", "Nodes with late telemetry."),
    _f("row", "nodes_offline", "polca_row_nodes_offline", "Nodes whose Last Will fired."),
    _f(
        "row",
        "meter_trusted",
        "polca_row_meter_trusted",
        "1 while the row's meter is believed, 0 while its readings are refused or held "
        "(absent for a row without a meter).",
    ),
    _f(
        "row",
        "meter_refusals",
        "polca_row_meter_refusals_total",
        "Meter readings refused (implausible, under-reading or frozen) since start.",
    ),
    _f(
        "row",
        "electrical_budget_w",
        "polca_row_electrical_budget_watts",
        "Electrical budget the row runs on: the least of its own, the site controller's "
        "lease (or its fallback once the lease lapsed) and its feeds up.",
    ),
    _f(
        "row",
        "leased_budget_w",
        "polca_row_leased_budget_watts",
        "The site controller's budget while its lease is valid (absent: none).",
    ),
    _f(
        "row",
        "on_fallback",
        "polca_row_on_fallback",
        "1 while the row runs on its fallback budget (no valid lease from the site controller).",
    ),
    _f("control", "level", "polca_control_level", "Level of each control scope."),
    _f("control", "lease_s", "polca_control_lease_seconds", "Lease granted per message."),
    _f(
        "control",
        "seq",
        "polca_control_messages_total",
        "Control messages published for the scope (decisions and lease renewals).",
    ),
    _f(
        "control",
        "brakes",
        "polca_control_brakes_total",
        "Entries of the scope into the policy's top level (the brake).",
    ),
    # Cooling loops.
    _f("cooling_loop", "severity", "polca_cooling_loop_severity", "Worst active alarm (0-3)."),
    _f("cooling_loop", "alarms", "polca_cooling_loop_alarms", "Active alarms."),
    _f(
        "cooling_loop",
        "headroom_kw",
        "polca_cooling_loop_headroom_watts",
        "Heat headroom.",
        scale=1e3,
    ),
    _f("cooling_loop", "emergency", "polca_cooling_loop_emergency", "1 in a cooling emergency."),
    _f("cooling_loop", "stale", "polca_cooling_loop_stale", "1 while the CDU's data is late."),
    # The aggregator's own health.
    _f(
        "aggregator",
        "messages_in",
        "polca_aggregator_messages_total",
        "MQTT messages received.",
    ),
    _f("aggregator", "spool_bytes", "polca_aggregator_spool_bytes", "InfluxDB spool size."),
    _f(
        "aggregator",
        "points_written",
        "polca_aggregator_points_written_total",
        "Points the database accepted.",
    ),
    _f(
        "aggregator",
        "points_spooled",
        "polca_aggregator_points_spooled_total",
        "Points written to the spool during outages.",
    ),
    _f(
        "aggregator",
        "points_dropped",
        "polca_aggregator_points_dropped_total",
        "Points the InfluxDB sink gave up.",
    ),
    _f(
        "aggregator",
        "control_step_failures",
        "polca_aggregator_control_step_failures_total",
        "Control steps that raised and published nothing (retried the next interval).",
    ),
    _f(
        "gpu_workload",
        "assigned",
        "polca_gpu_workload_info",
        "1 for each GPU's runtime class, where it came from (class_origin) and the "
        "namespace, pod and container holding it.",
    ),
    # Each MQTT connection of the process (agent: one; aggregator: control and intake).
    _f(
        "mqtt",
        "connected",
        "polca_mqtt_connected",
        "1 while connected; the endpoint label names the broker node (none between them).",
    ),
    _f("mqtt", "connects", "polca_mqtt_connects_total", "Connections made to the broker."),
    _f(
        "mqtt",
        "failovers",
        "polca_mqtt_failovers_total",
        "Connections made to another broker endpoint than the one before.",
    ),
    # Per node with a BMC, from the aggregator's out-of-band writes.
    _f("oob", "caps", "polca_oob_caps_total", "Out-of-band caps written and verified."),
    _f("oob", "releases", "polca_oob_releases_total", "Out-of-band caps lifted and verified."),
    _f(
        "oob",
        "failures",
        "polca_oob_failures_total",
        "Out-of-band writes that failed or read back another limit (retried).",
    ),
    _f("oob", "capped", "polca_oob_capped", "1 while the node is capped through its BMC."),
    _f("oob", "limit_w", "polca_oob_limit_watts", "The BMC's limit read back after a write."),
    # The power tree, from the site controller (its leader only).
    _f(
        "power_domain",
        "capacity_w",
        "polca_power_domain_capacity_watts",
        "What the domain can carry now: its rating, its feeds up, a UPS on battery, a limit.",
    ),
    _f(
        "power_domain",
        "unlimited_w",
        "polca_power_domain_unlimited_capacity_watts",
        "The domain's capacity now without the operators' limit.",
    ),
    _f(
        "power_domain",
        "budget_w",
        "polca_power_domain_budget_watts",
        "What the allocation lets the domain's rows draw now.",
    ),
    _f(
        "power_domain",
        "nominal_w",
        "polca_power_domain_nominal_watts",
        "The domain's share with every feed up (the design), for the same demand.",
    ),
    _f(
        "power_domain",
        "measured_w",
        "polca_power_domain_measured_watts",
        "Power the domain's rows draw, from their summaries.",
    ),
    _f("power_domain", "rating_w", "polca_power_domain_rating_watts", "The domain's rating."),
    _f(
        "power_domain",
        "limit_w",
        "polca_power_domain_limit_watts",
        "An operator's limit on the domain (absent: none).",
    ),
    _f(
        "power_domain",
        "on_battery",
        "polca_power_domain_on_battery",
        "1 while a UPS is on battery.",
    ),
    _f("power_domain", "feeds_up", "polca_power_domain_feeds_up", "The domain's feeds up."),
    _f("power_domain", "feeds_down", "polca_power_domain_feeds_down", "The domain's feeds down."),
    _f("power_feed", "up", "polca_power_feed_up", "1 while the feed counts as up, 0 once down."),
    _f("power_feed", "rating_w", "polca_power_feed_rating_watts", "The feed's rating."),
    _f(
        "power_feed",
        "dark_polls",
        "polca_power_feed_dark_polls",
        "Consecutive meter polls in which none of the feed's sources answered.",
    ),
    _f(
        "row_budget",
        "budget_w",
        "polca_power_row_budget_watts",
        "The budget the site controller leases the row now.",
    ),
    _f(
        "row_budget",
        "nominal_w",
        "polca_power_row_nominal_watts",
        "The row's share with every feed up (the design).",
    ),
    _f(
        "row_budget",
        "measured_w",
        "polca_power_row_measured_watts",
        "The row's power from its summary (absent: none yet).",
    ),
    _f("row_budget", "rating_w", "polca_power_row_rating_watts", "The row's rating."),
    _f(
        "row_budget",
        "limited",
        "polca_power_row_limited",
        "1 while a domain's cut (a feed down, a UPS on battery, a limit) holds the row below "
        "its nominal share.",
    ),
    _f(
        "row_budget",
        "stale",
        "polca_power_row_stale",
        "1 while the row's summary is late (its last demand is used).",
    ),
)
_BY_MEASUREMENT: Final = {
    m: tuple(f for f in FAMILIES if f.measurement == m) for m in {f.measurement for f in FAMILIES}
}
_CATALOGUE: Final = {f.name: f for f in FAMILIES}  # one Family stands for its name
CLOCK_EVENT_FAMILY: Final = "polca_gpu_clock_event_active"
BUDGET_ORIGIN_FAMILY: Final = "polca_row_budget_origin"
"""From ``row.budget_origin``: one series per origin, 1 for the one in force."""
BUDGET_ORIGINS: Final = typing.get_args(BudgetOrigin)
DROPPED_FAMILY: Final = "polca_aggregator_messages_dropped_total"
IMPLAUSIBLE_FAMILY: Final = "polca_aggregator_implausible_telemetry_total"
_BY_REASON: Final = {"dropped_": DROPPED_FAMILY, "implausible_": IMPLAUSIBLE_FAMILY}
"""Aggregator fields ``<prefix><reason>``: one family each, the reason as a label."""
Labels = tuple[tuple[str, str], ...]


class _Series(Collector):
    """The latest value per (family, labels), collected under a lock."""

    def __init__(self, *, max_series: int, stale_after_s: float, clock: Callable[[], float]):
        self.lock = threading.Lock()
        self.values: dict[tuple[str, Labels], tuple[float, float]] = {}  # -> (value, at_s)
        self.max_series = max_series
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.refused = 0

    def set(self, family: str, labels: Labels, value: float, at_s: float) -> None:
        key = (family, labels)
        if key not in self.values and len(self.values) >= self.max_series:
            self.refused += 1
            return
        self.values[key] = (value, at_s)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self.clock()
        with self.lock:
            fresh = {
                key: value
                for key, (value, at_s) in self.values.items()
                if now - at_s <= self.stale_after_s
            }
        by_family: dict[str, list[tuple[Labels, float]]] = {}
        for (family, labels), value in fresh.items():
            by_family.setdefault(family, []).append((labels, value))
        for name, samples in sorted(by_family.items()):
            spec = _CATALOGUE.get(name)
            kind = spec.kind if spec else ("counter" if name.endswith("_total") else "gauge")
            help_text = spec.help if spec else _EXTRA_HELP.get(name, name)
            # Series of one family may differ in which tags they have (a GPU without a
            # class): every series gets every label, "" (Prometheus: absent) where missing.
            keys = sorted({k for labels, _ in samples for k, _ in labels})
            base = name.removesuffix("_total")
            metric: GaugeMetricFamily | CounterMetricFamily = (
                CounterMetricFamily(base, help_text, labels=keys)
                if kind == "counter"
                else GaugeMetricFamily(name, help_text, labels=keys)
            )
            for labels, value in samples:
                given = dict(labels)
                metric.add_metric([given.get(k, "") for k in keys], value)
            yield metric


_EXTRA_HELP: Final = {
    CLOCK_EVENT_FAMILY: "1 while NVML reports this clock event reason for the GPU.",
    BUDGET_ORIGIN_FAMILY: "1 for where the row's electrical budget comes from now "
    "(config, lease, fallback, feeds), 0 for the others.",
    DROPPED_FAMILY: "MQTT messages the aggregator dropped, by reason.",
    IMPLAUSIBLE_FAMILY: "Telemetry messages held to their node's plausible bound, by reason.",
}


def _labels(tags: dict[str, str] | Any) -> Labels:
    return tuple(
        sorted((_LABELS.get(k, k), str(v)) for k, v in tags.items() if k not in _LEFT_OUT_TAGS)
    )


class PrometheusSink:
    """The latest value of every series, served at ``http://ADDRESS/metrics``."""

    def __init__(
        self,
        address: str,
        *,
        max_series: int = 250_000,
        stale_after_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        snapshots: frozenset[str] = frozenset(),
    ) -> None:
        """Serve at ``address`` (HOST:PORT). ``snapshots`` names measurements that every
        write carries whole (the agent's ``gpu_cap``): a write of one replaces all of its
        series, so a series whose labels changed (the reason of a cap) goes at once."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            msg = f"metrics.address {address!r} must be HOST:PORT"
            raise ValueError(msg)
        self.host, self.port = host.strip("[]") or "127.0.0.1", int(port)
        self.registry = CollectorRegistry()
        self.series = _Series(max_series=max_series, stale_after_s=stale_after_s, clock=clock)
        self.registry.register(self.series)
        self._clock = clock
        self._snapshots = {
            m: frozenset(f.name for f in _BY_MEASUREMENT.get(m, ())) for m in snapshots
        }
        self._closed = asyncio.Event()
        self._server: Any = None
        self._written = 0
        self._log = structlog.get_logger().bind(sink="prometheus", address=address)

    def write(self, points: Sequence[AnyPoint]) -> None:
        """Keep the latest value of each series the points carry; never raises."""
        now = self._clock()
        with self.series.lock:
            replaced = {point.measurement for point in points} & self._snapshots.keys()
            if replaced:
                names = frozenset().union(*(self._snapshots[m] for m in replaced))
                for key in [k for k in self.series.values if k[0] in names]:
                    del self.series.values[key]
            for point in points:
                families = _BY_MEASUREMENT.get(point.measurement)
                if families is None and point.measurement != "aggregator":
                    continue
                try:
                    labels = _labels(point.tags)
                    fields = point.fields
                except (AttributeError, TypeError, ValueError):
                    continue
                for spec in families or ():
                    value = fields.get(spec.field)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        named = (*labels, *spec.labels) if spec.labels else labels
                        self.series.set(spec.name, named, float(value) * spec.scale, now)
                if point.measurement == "gpu":
                    mask = fields.get("clock_event_reasons")
                    if isinstance(mask, int):
                        for bit, reason in CLOCK_EVENT_NAMES.items():
                            self.series.set(
                                CLOCK_EVENT_FAMILY,
                                (*labels, ("reason", reason)),
                                1.0 if mask & bit else 0.0,
                                now,
                            )
                elif point.measurement == "row":
                    origin = fields.get("budget_origin")
                    if isinstance(origin, str):
                        for name in BUDGET_ORIGINS:
                            self.series.set(
                                BUDGET_ORIGIN_FAMILY,
                                (*labels, ("origin", name)),
                                1.0 if origin == name else 0.0,
                                now,
                            )
                elif point.measurement == "aggregator":
                    for name, value in fields.items():
                        prefix, _, reason = name.partition("_")
                        family = _BY_REASON.get(prefix + "_")
                        if family is not None and reason and isinstance(value, int):
                            self.series.set(
                                family, (*labels, ("reason", reason)), float(value), now
                            )
                self._written += 1

    async def run(self) -> None:
        """Serve ``/metrics`` until closed (prometheus-client's HTTP thread)."""
        try:
            self._server, _thread = start_http_server(
                self.port, addr=self.host, registry=self.registry
            )
        except OSError as exc:
            self._log.error("metrics_not_served", error=str(exc))
            await self._closed.wait()
            return
        self._log.info("metrics_served", url=f"http://{self.host}:{self.port}/metrics")
        try:
            await self._closed.wait()
        finally:
            self._server.shutdown()
            self._server.server_close()

    async def close(self, timeout_s: float) -> None:
        """Stop serving."""
        self._closed.set()

    @property
    def stats(self) -> SinkStats:
        """Nothing is written to a database here: only the series refused for the bound."""
        refused = self.series.refused
        return SinkStats(
            points_dropped=refused, dropped={"series_limit": refused} if refused else {}
        )


def metrics_sinks(
    metrics: MetricsSettings, *, snapshots: frozenset[str] = frozenset()
) -> list[PrometheusSink]:
    """The Prometheus sink ``metrics.address`` asks for (none when unset); ``snapshots``:
    the measurements written whole each time (``PrometheusSink``)."""
    if not metrics.address:
        return []
    return [
        PrometheusSink(
            metrics.address,
            max_series=metrics.max_series,
            stale_after_s=metrics.stale_after_s,
            snapshots=snapshots,
        )
    ]
