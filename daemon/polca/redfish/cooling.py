"""Read a Redfish ``CoolingUnit`` (a CDU) into polca's ``CduTelemetry``: pure, no I/O.

Why it exists: a CDU that speaks Redfish describes itself as a ``CoolingUnit``
(``/redfish/v1/ThermalEquipment/CDUs/{id}``) with linked resources: its primary and
secondary ``CoolantConnector`` collections (supply and return temperature, flow, delta
pressure, heat removed, each a sensor excerpt ``{"Reading": ...}``), its ``Pumps``,
``Filters``, ``LeakDetection`` (with ``LeakDetectorGroups`` of ``DetectorState``
excerpts, or a ``LeakDetectors`` collection), ``EnvironmentMetrics`` and
``CoolingCapacityWatts``. The poller (``polca.cdu.redfish``) GETs them and hands the
documents here; ``read_cooling_unit`` fills the same ``CduTelemetry`` the Modbus map
fills (``polca.cdu.registers.assemble``), with the same units (C, L/min, kPa, kW, %).

How it fails: every value is untrusted. A field that is present but unusable (not a
number, NaN, out of the wire schema's bounds, ``null``, an unknown state) is left out, or
takes its conservative value for states (a pump in an unknown state is ``failed``, a leak
detector or health in an unknown state is ``critical``), and is returned as a
``Problem`` (field, reason) so the poller logs it once. A field that is absent is not a
problem: a CDU reports what it measures. Only a document that is not a ``CoolingUnit``
at all raises, and only ``ReadingRejectedError`` (``malformed`` or ``identity``).

Several connectors on one side fold into one ``CoolantConnector`` conservatively: the
warmest supply and return, the sum of the flows and heat that could be read (an
unreadable flow meter lowers the sum, it never raises it), the lowest delta pressure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from polca.errors import ReadingRejectedError
from polca.readings import checked_number
from polca.redfish.documents import check_type, excerpt_reading
from polca.telemetry.schema import CduTelemetry

__all__ = [
    "MAX_CONNECTORS",
    "MAX_FILTERS",
    "CduDocuments",
    "CduReading",
    "Problem",
    "read_cooling_unit",
]

MAX_CONNECTORS = 16
"""Coolant connectors read on each side of a CDU."""
MAX_FILTERS = 16
"""Filters read of a CDU."""
MAX_PUMPS = 16  # the wire schema's bound (CduTelemetry.pumps)
MAX_LEAK_DETECTORS = 64  # the wire schema's bound (CduTelemetry.leak_detectors)
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_PERCENT_SLACK = 0.5  # as registers.py: 100.3 % reads as 100 %, 101 % as invalid

Health = Literal["ok", "warning", "critical"]
_HEALTH: dict[str, Health] = {"OK": "ok", "Warning": "warning", "Critical": "critical"}
_PUMP_STATES = {
    "Enabled": "running",
    "Starting": "running",
    "StandbyOffline": "standby",
    "StandbySpare": "standby",
    "Disabled": "off",
    "Absent": "off",
}
# Valid Redfish states in which a pump cannot be counted on: read as failed, no problem.
_PUMP_NOT_RUNNING = frozenset({"UnavailableOffline", "InTest", "Updating", "Deferring", "Quiesced"})
# Connector fields: (Redfish property, polca field, low, high)
_CONNECTOR_FIELDS = (
    ("SupplyTemperatureCelsius", "supply_temp_c", -60.0, 300.0),
    ("ReturnTemperatureCelsius", "return_temp_c", -60.0, 300.0),
    ("FlowLitersPerMinute", "flow_lpm", 0.0, 100_000.0),
    ("DeltaPressurekPa", "delta_pressure_kpa", -1000.0, 10_000.0),
    ("HeatRemovedkW", "heat_removed_kw", -100_000.0, 100_000.0),
)


@dataclass(frozen=True, slots=True)
class Problem:
    """A value of the CDU's documents that could not be used; ``field`` is polca's name."""

    field: str
    reason: str


@dataclass(frozen=True, slots=True)
class CduDocuments:
    """The documents of one poll of a CDU, as the service returned them (untrusted)."""

    unit: object
    secondary: Sequence[object] = ()
    primary: Sequence[object] = ()
    pumps: Sequence[object] = ()
    leak_detection: object | None = None
    leak_detectors: Sequence[object] = ()
    """``LeakDetector`` documents, read when ``LeakDetection`` has no detector groups."""
    filters: Sequence[object] = ()
    environment: object | None = None


@dataclass(frozen=True, slots=True)
class CduReading:
    """The telemetry of one poll, what could not be used, and what the wire has no field for."""

    telemetry: CduTelemetry
    problems: tuple[Problem, ...]
    cooling_capacity_w: float | None = None
    """``CoolingCapacityWatts``: the manufacturer's rating."""
    power_w: float | None = None
    """The CDU's own power draw (``EnvironmentMetrics.PowerWatts``)."""
    filters: tuple[tuple[str, Health], ...] = field(default=())
    """Each filter's name and health (``Status.Health``; unknown reads ``critical``)."""


# -- the reader ----------------------------------------------------------------------------


class _Reader:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def problem(self, field: str, reason: str) -> None:
        self.problems.append(Problem(field, reason))

    def typed(self, doc: object, type_name: str, field: str) -> Mapping[str, Any] | None:
        try:
            return check_type(doc, type_name, what=field)
        except ReadingRejectedError as exc:
            self.problem(field, exc.reason)
            return None

    def number(
        self, doc: Mapping[str, Any], key: str, field: str, low: float, high: float
    ) -> float | None:
        try:
            return excerpt_reading(doc, key, low=low, high=high)
        except ReadingRejectedError as exc:
            self.problem(field, exc.reason)
            return None

    def health(self, doc: Mapping[str, Any], field: str) -> Health | None:
        """``Status.Health``: None when not reported; ``null`` reads ``warning`` and an
        unknown value ``critical`` (both problems)."""
        status = doc.get("Status")
        if status is None:
            return None
        if not isinstance(status, Mapping):
            self.problem(field, "malformed")
            return "critical"
        if "Health" not in status:
            return None
        raw = status["Health"]
        if raw is None:  # the service does not know its health right now
            self.problem(field, "unsupported")
            return "warning"
        health = _HEALTH.get(raw) if isinstance(raw, str) else None
        if health is None:
            self.problem(field, "unknown_state")
            return "critical"
        return health

    def state(self, doc: Mapping[str, Any]) -> str | None:
        status = doc.get("Status")
        raw = status.get("State") if isinstance(status, Mapping) else None
        return raw if isinstance(raw, str) else None

    def name(self, raw: object, fallback: str, taken: set[str]) -> str:
        name = raw if isinstance(raw, str) and _NAME.fullmatch(raw) else fallback
        if name in taken:
            name = fallback if fallback not in taken else f"{fallback}-{len(taken)}"
        taken.add(name)
        return name

    def connector(self, docs: Sequence[object], side: str) -> dict[str, float]:
        values: dict[str, list[float]] = {}
        for i, raw in enumerate(docs[:MAX_CONNECTORS]):
            doc = self.typed(raw, "CoolantConnector", f"{side}.{i}")
            if doc is None:
                continue
            for key, name, low, high in _CONNECTOR_FIELDS:
                value = self.number(doc, key, f"{side}.{name}", low, high)
                if value is not None:
                    values.setdefault(name, []).append(value)
        if len(docs) > MAX_CONNECTORS:
            self.problem(side, "oversized")
        folded: dict[str, float] = {}
        for name, found in values.items():
            if name in {"supply_temp_c", "return_temp_c"}:
                folded[name] = max(found)
            elif name == "delta_pressure_kpa":
                folded[name] = min(found)
            else:
                total = sum(found)
                high = 100_000.0
                folded[name] = min(high, max(-high, total))
        return folded

    def pumps(self, docs: Sequence[object]) -> list[dict[str, Any]]:
        pumps: list[dict[str, Any]] = []
        taken: set[str] = set()
        if len(docs) > MAX_PUMPS:
            self.problem("pumps", "oversized")
        for i, raw in enumerate(docs[:MAX_PUMPS]):
            field = f"pumps.{i}"
            doc = self.typed(raw, "Pump", field)
            pump: dict[str, Any] = {
                "name": self.name(doc.get("Id") if doc else None, f"pump{i + 1}", taken)
            }
            if doc is None:
                pump["state"] = "failed"
                pumps.append(pump)
                continue
            pump["state"] = self.pump_state(doc, f"{field}.state")
            speed = self.number(doc, "PumpSpeedPercent", f"{field}.speed_pct", -0.5, 100.5)
            if speed is not None:
                pump["speed_pct"] = min(100.0, max(0.0, speed))
            pumps.append(pump)
        return pumps

    def pump_state(self, doc: Mapping[str, Any], field: str) -> str:
        """Redfish ``Status.State`` (and ``Health``) as polca's pump state."""
        state = self.state(doc)
        health = self.health(doc, field)
        if state is None:
            self.problem(field, "missing")
            return "failed"
        if state not in _PUMP_STATES and state not in _PUMP_NOT_RUNNING:
            self.problem(field, "unknown_state")
        mapped = _PUMP_STATES.get(state, "failed")
        if mapped == "running" and health == "critical":
            return "failed"
        return mapped

    def leaks(self, detection: object | None, detectors: Sequence[object]) -> list[dict[str, str]]:
        if detection is None:
            return []
        doc = self.typed(detection, "LeakDetection", "leak_detection")
        if doc is None:  # unreadable leak detection is not "no leak"
            return [{"name": "leak_detection", "state": "critical"}]
        found: list[tuple[object, object]] = []  # (name candidate, DetectorState)
        groups = doc.get("LeakDetectorGroups")
        if groups is not None and not isinstance(groups, list):
            self.problem("leak_detectors", "malformed")
            found.append(("leak_detection", None))
        for group in groups if isinstance(groups, list) else []:
            members = group.get("Detectors") if isinstance(group, Mapping) else None
            if not isinstance(members, list):
                self.problem("leak_detectors", "malformed")
                found.append(("leak_detection", None))
                continue
            for member in members:
                if not isinstance(member, Mapping):
                    found.append((None, None))
                    continue
                uri = member.get("DataSourceUri")
                name = uri.rstrip("/").rsplit("/", 1)[-1] if isinstance(uri, str) else None
                found.append((name, member.get("DetectorState")))
        if not found:
            for i, raw in enumerate(detectors):
                detector = self.typed(raw, "LeakDetector", f"leak_detectors.{i}")
                if detector is None:
                    found.append((None, None))
                elif self.state(detector) != "Absent":
                    found.append((detector.get("Id"), detector.get("DetectorState")))
        if not found and "Status" in doc:  # a summary only
            health = self.health(doc, "leak_detectors.0.state")
            return [{"name": "leak_detection", "state": health or "ok"}]
        if len(found) > MAX_LEAK_DETECTORS:
            self.problem("leak_detectors", "oversized")
            worst = max((_rank(s) for _, s in found[MAX_LEAK_DETECTORS - 1 :]), default=0)
            found = [*found[: MAX_LEAK_DETECTORS - 1], ("leak_rest", _UNRANK[worst])]
        leaks: list[dict[str, str]] = []
        taken: set[str] = set()
        for i, (raw_name, raw_state) in enumerate(found):
            state = _HEALTH.get(raw_state) if isinstance(raw_state, str) else None
            if state is None:
                self.problem(f"leak_detectors.{i}.state", "unknown_state")
                state = "critical"
            leaks.append({"name": self.name(raw_name, f"leak{i + 1}", taken), "state": state})
        return leaks

    def filters(self, docs: Sequence[object]) -> tuple[tuple[str, Health], ...]:
        filters: list[tuple[str, Health]] = []
        taken: set[str] = set()
        for i, raw in enumerate(docs[:MAX_FILTERS]):
            doc = self.typed(raw, "Filter", f"filters.{i}")
            name = self.name(doc.get("Id") if doc else None, f"filter{i + 1}", taken)
            health = self.health(doc, f"filters.{i}.health") if doc is not None else "critical"
            filters.append((name, health or "ok"))
        return tuple(filters)


_RANKS = {"OK": 0, "Warning": 1, "Critical": 2}
_UNRANK = {0: "OK", 1: "Warning", 2: "Critical"}


def _rank(state: object) -> int:
    return _RANKS.get(state, 2) if isinstance(state, str) else 2


def read_cooling_unit(docs: CduDocuments, *, cdu: str, loop: str, ts_ns: int) -> CduReading:
    """The CDU's telemetry (named ``cdu``, serving ``loop``) from one poll's documents.

    Raises ``ReadingRejectedError`` only when ``docs.unit`` is not a ``CoolingUnit``; every
    other unusable value is left out (or conservative) and listed in ``problems``.
    """
    unit = check_type(docs.unit, "CoolingUnit", what="the CDU")
    reader = _Reader()
    status = reader.health(unit, "status") or "ok"
    if reader.state(unit) in {"Disabled", "UnavailableOffline"}:
        status = "critical"  # a disabled CDU cools nothing, whatever its health says
    message: dict[str, Any] = {
        "ts_ns": ts_ns,
        "cdu": cdu,
        "loop": loop,
        "secondary": reader.connector(docs.secondary, "secondary"),
        "pumps": reader.pumps(docs.pumps),
        "leak_detectors": reader.leaks(docs.leak_detection, docs.leak_detectors),
        "status": status,
    }
    if docs.primary:
        message["primary"] = reader.connector(docs.primary, "primary")
    capacity_w = None
    if "CoolingCapacityWatts" in unit:
        try:
            capacity_w = checked_number(
                unit["CoolingCapacityWatts"], what="CoolingCapacityWatts", low=0.0, high=1e8
            )
        except ReadingRejectedError as exc:
            reader.problem("cooling_capacity_w", exc.reason)
    power_w = None
    if docs.environment is not None:
        env = reader.typed(docs.environment, "EnvironmentMetrics", "environment")
        if env is not None:
            power_w = reader.number(env, "PowerWatts", "power_w", 0.0, 1e7)
    filters = reader.filters(docs.filters)
    telemetry = CduTelemetry.model_validate(message)
    return CduReading(
        telemetry=telemetry,
        problems=tuple(reader.problems),
        cooling_capacity_w=capacity_w,
        power_w=power_w,
        filters=filters,
    )
