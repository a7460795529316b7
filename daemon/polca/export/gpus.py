"""The points of a node's telemetry message: one ``gpu`` point per GPU, and a ``gpu_health``
point per GPU whose health counters came with it (pure); ``HealthBacklog`` keeps the
counters whose write interval had not passed for the node's next due message.

Shared by the aggregator (every sink: InfluxDB, Prometheus) and the agent (its own
``/metrics``), so the two paths name and type every GPU reading the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from polca.export.points import LineTemplate, Point, SeriesPoint, make_point
from polca.export.schema import SCHEMA
from polca.telemetry.schema import GpuHealthReport, Telemetry

_GPU_FIELDS: Final = tuple(SCHEMA["gpu"].fields)
"""The ``gpu`` fields in ``SCHEMA``'s order: ``gpu_points`` fills its values in this order."""
_GPU: Final = LineTemplate(
    "gpu",
    tag_keys=("class", "gpu_index", "gpu_uuid", "model", "node", "rack", "row", "site"),
    fields=_GPU_FIELDS,
)
_INDEX_TEXT: Final = tuple(str(i) for i in range(1024))
"""``GpuTelemetry.index`` is 0..1023."""


def gpu_points(telemetry: Telemetry, *, site: str, row: str, rack: str) -> list[SeriesPoint]:
    """One ``gpu`` point per GPU of a node's telemetry message (the sink's hot path).

    ``power_w`` is the mean power over the publish interval (the last reading when the
    agent sent no mean); ``lost`` is 1.0 for a GPU the agent reported lost. Missing
    readings are left out, not written as zero. The wire schema has already typed every
    value (floats, integers, never booleans), as ``LineTemplate`` requires.
    """
    ts_ns, node, point = telemetry.ts_ns, telemetry.node, _GPU.point
    return [
        point(
            (
                gpu.priority_class or "",
                _INDEX_TEXT[gpu.index],
                gpu.uuid,
                gpu.name,
                node,
                rack,
                row,
                site,
            ),
            (
                gpu.power_mean_w if gpu.power_mean_w is not None else gpu.power_w,
                gpu.power_max_w,
                gpu.power_avg_w,
                gpu.energy_j,
                gpu.energy_delta_j,
                gpu.gpu_temp_c,
                gpu.gpu_temp_max_c,
                gpu.mem_temp_c,
                gpu.sm_clock_mhz,
                gpu.mem_clock_mhz,
                gpu.gpu_util_pct,
                gpu.mem_util_pct,
                gpu.power_limit_w,
                gpu.enforced_power_limit_w,
                gpu.locked_sm_clock_max_mhz,
                gpu.clock_event_reasons,
                1.0 if gpu.state == "lost" else 0.0,
            ),
            ts_ns,
        )
        for gpu in telemetry.gpus
    ]


def gpu_workload_points(telemetry: Telemetry, *, site: str, row: str, rack: str) -> list[Point]:
    """One ``gpu_workload`` point (``assigned`` 1.0) per GPU whose runtime class has an
    origin: its class, where it came from, and the namespace, pod and container holding
    it (empty when none). An info series: its tags are the news, one per GPU and pod."""
    out: list[Point] = []
    for gpu in telemetry.gpus:
        if gpu.class_origin is None:
            continue
        workload = gpu.workload
        out.append(
            make_point(
                "gpu_workload",
                ts_ns=telemetry.ts_ns,
                tags={
                    "site": site,
                    "row": row,
                    "rack": rack,
                    "node": telemetry.node,
                    "gpu_uuid": gpu.uuid,
                    "gpu_index": _INDEX_TEXT[gpu.index],
                    "class": gpu.priority_class or "",
                    "class_origin": gpu.class_origin,
                    "namespace": workload.namespace if workload else "",
                    "pod": workload.pod if workload else "",
                    "container": workload.container if workload else "",
                },
                fields={"assigned": 1.0},
            )
        )
    return out


_HEALTH_FIELDS: Final = tuple(SCHEMA["gpu_health"].fields)
_HEALTH: Final = LineTemplate(
    "gpu_health",
    tag_keys=("gpu_index", "gpu_uuid", "model", "node", "rack", "row", "site"),
    fields=_HEALTH_FIELDS,
)


def gpu_health_points(
    telemetry: Telemetry,
    *,
    site: str,
    row: str,
    rack: str,
    health: Mapping[int, GpuHealthReport] | None = None,
) -> list[SeriesPoint]:
    """One ``gpu_health`` point per GPU with counters: those the message carries (the
    agent sends them when they change and every ``agent.health_every_s``), or ``health``
    by GPU index (the agent's latest, for its own sinks). Unsupported ones are left out."""
    ts_ns, node, point = telemetry.ts_ns, telemetry.node, _HEALTH.point
    out: list[SeriesPoint] = []
    for gpu in telemetry.gpus:
        h = gpu.health if health is None else health.get(gpu.index)
        if h is None:
            continue
        # The wire names are the schema's; flags (0/1 integers) go into float fields.
        values = tuple(getattr(h, name) for name in _HEALTH_FIELDS)
        tags = (_INDEX_TEXT[gpu.index], gpu.uuid, gpu.name, node, rack, row, site)
        out.append(point(tags, values, ts_ns))
    return out


class HealthBacklog:
    """The newest health counters of each node's GPUs that are not written yet.

    ``gpu_health`` points obey a write interval per node (``export/schedule.py``): counters
    that arrive before it has passed wait here and go with the node's next due message,
    so a change (a new XID, an ECC error) is late by at most one interval, never lost,
    however often a node sends them. Bounded: nodes of the topology (the intake admits no
    other), GPU indices below 1024.
    """

    def __init__(self) -> None:
        """Nothing pending."""
        self._pending: dict[str, dict[int, GpuHealthReport]] = {}

    def add(self, telemetry: Telemetry) -> bool:
        """Keep the counters a message carries; whether any wait for its node."""
        reports = {g.index: g.health for g in telemetry.gpus if g.health is not None}
        if reports:
            self._pending.setdefault(telemetry.node, {}).update(reports)
        return telemetry.node in self._pending

    def take(self, node: str) -> dict[int, GpuHealthReport]:
        """The counters waiting for ``node`` (by GPU index), now written."""
        return self._pending.pop(node, {})
