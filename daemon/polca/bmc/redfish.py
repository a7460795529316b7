"""Power-limit control of one node through its BMC's Redfish service (pure of HTTP).

``BmcPowerControl`` reads, caps and restores a node's power limit through a
``RedfishSession`` (``polca.redfish.client`` is the HTTP one); it never speaks HTTP itself.

Discovery, once per BMC (``discover``): service root -> ``Chassis`` collection -> each
chassis (at most ``MAX_CHASSIS``), looking for a power control in two shapes
(platform-facts 12.2), the first preferred on each chassis:

- ``controls``: the chassis's ``Controls`` collection, a member with
  ``ControlType: "Power"`` (``SetPoint`` in its ``SetPointUnits``, W, mW or kW, converted;
  ``AllowableMin``, ``AllowableMax``, power from ``Sensor.Reading`` or the sensor its
  ``DataSourceUri`` names). A chassis may list several (a CPU's, a GPU baseboard's, the
  node's): the one that caps the node is the one whose ``PhysicalContext`` is the whole
  node's (``Chassis``, ``SystemBoard``, ``PowerSubsystem``), else the one whose sensor is
  the chassis's total power (``EnvironmentMetrics.PowerWatts``), else the only one without
  a context. A component's control (``CPU``, ``GPU``, ``Memory``, any other context) never
  is. Two candidates no rule tells apart are ``ConfigError`` naming them, unless the
  configuration names the control (``control``); a ``SetPointUnits`` polca does not know is
  ``ReadingRejectedError`` (``unsupported``), never read as watts. ``PowerControlShape.seen``
  lists every power control seen on the chosen chassis and why each was or was not taken;
- ``legacy``: ``Chassis/{id}/Power`` -> ``PowerControl[0]`` (``PowerLimit.LimitInWatts``,
  ``PowerConsumedWatts``, ``PowerCapacityWatts``; the allowable range from
  ``LimitInWatts@Redfish.AllowableNumbers`` when given, else 0 to ``PowerCapacityWatts``).

The chassis rule: the first chassis, in the collection's order, whose ``ChassisType`` is a
whole node or enclosure (``RackMount``, ``Enclosure``, ``StandAlone``) and that has a
power control; failing that, the first chassis with one (a sub-component such as a GPU
baseboard ``Module`` caps only part of the node). A chassis whose resources are missing or
malformed (a bad link, a document of another ``@odata.type``) is skipped, and the final
``unsupported`` error says why each was.

Links and bounds are ``polca.redfish.documents``': every link followed (``@odata.id``, a
sensor's ``DataSourceUri``) must be a path under ``/redfish/v1`` (``malformed`` otherwise,
before any request), and every document read must be of its ``@odata.type``
(``ServiceRoot``, ``Chassis``, ``Control``, ``Power``, ``Sensor``, ``EnvironmentMetrics``).
A ``Chassis`` collection of more than ``MAX_CHASSIS`` members, or ``Controls`` that take
discovery past ``MAX_CONTROLS`` controls in all, is refused (``oversized``), never cut
short: the control that caps the node could be among those not read.

Every value from the BMC is untrusted: a wrong type, NaN, a negative or absurd value
(over ``MAX_NODE_POWER_W``) is ``ReadingRejectedError`` with its reason, never a crash. A cap
outside the allowable range is ``ConfigError`` and is never written. A write is verified
by reading it back: a BMC that accepts it and reports another value gives
``verified=False``, never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from polca.actuation import read_back_ok
from polca.errors import ConfigError, ReadingRejectedError
from polca.readings import checked_number
from polca.redfish.api import RedfishSession
from polca.redfish.documents import check_type, member_links, odata_link, resource_path

__all__ = [
    "MAX_CHASSIS",
    "MAX_CONTROLS",
    "MAX_NODE_POWER_W",
    "BmcPowerControl",
    "BmcReading",
    "CapResult",
    "PowerControlShape",
    "SeenControl",
    "discover",
]

MAX_NODE_POWER_W: Final = 100_000.0
"""The most one node may draw or be limited to (100 kW); above is absurd."""
MAX_CHASSIS: Final = 256
"""Chassis a service may list; more is refused (``oversized``). A GPU server's BMC can list
dozens (each GPU, switch, retimer and ERoT of an HGX board), so the bound is well above."""
MAX_CONTROLS: Final = 64
"""Controls examined at most during discovery (over all chassis); more is refused."""
VERIFY_TOLERANCE_W: Final = 1.0
"""A read-back limit within this of the written one counts as applied."""
_NODE_TYPES: Final = frozenset({"RackMount", "Enclosure", "StandAlone"})
_MAX_ALLOWABLE: Final = 16
_MAX_REASONS: Final = 4  # skipped chassis named in the final "no power control" error


NODE_CONTEXTS: Final = frozenset({"Chassis", "SystemBoard", "PowerSubsystem"})
"""``PhysicalContext`` values of a control that caps the whole node."""
UNITS_W: Final[Mapping[str, float]] = {"W": 1.0, "mW": 1e-3, "kW": 1e3}
"""Watts per unit of each ``SetPointUnits`` polca converts (UCUM spellings)."""


@dataclass(frozen=True, slots=True)
class SeenControl:
    """One power control discovery examined, and what it made of it."""

    path: str
    physical_context: str | None
    units: str | None
    chosen: bool
    why: str


@dataclass(frozen=True, slots=True)
class PowerControlShape:
    """Where a BMC keeps its power limit: ``control`` is the resource path PATCHed."""

    chassis: str
    control: str
    kind: Literal["controls", "legacy"]
    w_per_unit: float = 1.0
    """Watts per unit of the control's ``SetPoint`` (``SetPointUnits``)."""
    seen: tuple[SeenControl, ...] = ()
    """Every power control seen on the chassis, the chosen one marked (``controls``)."""


@dataclass(frozen=True, slots=True)
class BmcReading:
    """One reading of a node's power and limit, in W (None where the BMC gives none)."""

    power_w: float | None
    limit_w: float | None
    limit_min_w: float | None
    limit_max_w: float | None
    control: str


@dataclass(frozen=True, slots=True)
class CapResult:
    """A limit written and read back: ``verified`` when the BMC reports what was written."""

    limit_w: float | None
    verified: bool


def _watts(value: object, *, what: str) -> float | None:
    """A power in W from the BMC, None when it gives none (absent or null)."""
    if value is None:
        return None
    return checked_number(value, what=what, low=0.0, high=MAX_NODE_POWER_W)


async def discover(
    session: RedfishSession, *, chassis_id: str | None = None, control: str | None = None
) -> PowerControlShape:
    """The BMC's power control, by the chassis and control rules in the module's docstring.

    ``chassis_id`` names the chassis to use (an enclosure manager serving several nodes):
    only the chassis whose path ends in it is considered. ``control`` names the control
    (its path or its last segment) where a chassis has several no rule tells apart. Raises
    ``ReadingRejectedError``: ``unsupported`` when no chassis has one (saying why chassis
    were skipped), ``malformed``/``identity`` when the service root or the chassis
    collection is not what Redfish promises (a link outside ``/redfish/v1`` included),
    ``oversized`` past ``MAX_CHASSIS`` or ``MAX_CONTROLS``; ``ConfigError`` when a chassis
    has two candidates and ``control`` names neither.
    """
    root = check_type(await session.get("/redfish/v1"), "ServiceRoot", what="service root")
    chassis_path = odata_link(root, "Chassis", what="service root")
    if chassis_path is None:
        msg = "service root has no Chassis collection"
        raise ReadingRejectedError(msg, reason="unsupported")
    chassis_list = member_links(
        await session.get(chassis_path), what=chassis_path, limit=MAX_CHASSIS
    )
    budget = [MAX_CONTROLS]
    fallback: PowerControlShape | None = None
    skipped: list[ReadingRejectedError] = []
    if chassis_id is not None:
        chassis_list = tuple(p for p in chassis_list if p.rsplit("/", 1)[-1] == chassis_id)
    for path in chassis_list:
        try:
            chassis = check_type(await session.get(path), "Chassis", what=path)
        except ReadingRejectedError as exc:
            skipped.append(exc)
            continue  # a broken chassis: look at the others
        shape = None
        try:
            shape = await _controls_shape(session, chassis, path, budget, control)
        except ReadingRejectedError as exc:
            if exc.reason == "oversized":
                raise  # controls not read could hold the node's: never choose without them
            if exc.reason == "unsupported" and "SetPointUnits" in str(exc):
                raise  # the node's control, in units polca does not know: never guessed
            skipped.append(exc)  # broken Controls: try the legacy shape
        if shape is None and control is None:  # a named control is one of Controls'
            try:
                shape = await _legacy_shape(session, chassis, path)
            except ReadingRejectedError as exc:
                skipped.append(exc)
        if shape is None:
            continue
        if chassis.get("ChassisType") in _NODE_TYPES:
            return shape
        if fallback is None:
            fallback = shape
    if fallback is not None:
        return fallback
    if control is not None:
        msg = f"no power control {control!r} on any of {len(chassis_list)} chassis"
        raise ConfigError(msg)
    msg = f"no power control on any of {len(chassis_list)} chassis{_reasons(skipped)}"
    raise ReadingRejectedError(msg, reason="unsupported")


def _reasons(skipped: list[ReadingRejectedError]) -> str:
    """Why chassis or their resources were skipped, for an error message (bounded)."""
    if not skipped:
        return ""
    shown = "; ".join(f"{str(exc)[:160]} ({exc.reason})" for exc in skipped[:_MAX_REASONS])
    more = f"; {len(skipped) - _MAX_REASONS} more" if len(skipped) > _MAX_REASONS else ""
    return f" (skipped: {shown}{more})"


@dataclass(frozen=True, slots=True)
class _Candidate:
    path: str
    context: str | None
    units: str | None
    sensor: str | None


def _text(value: object) -> str | None:
    return value[:64] if isinstance(value, str) else None


async def _controls_shape(
    session: RedfishSession,
    chassis: Mapping[str, Any],
    path: str,
    budget: list[int],
    named: str | None = None,
) -> PowerControlShape | None:
    controls_path = odata_link(chassis, "Controls", what=path)
    if controls_path is None:
        return None
    members = member_links(await session.get(controls_path), what=controls_path, limit=MAX_CONTROLS)
    if len(members) > budget[0]:
        msg = (
            f"{controls_path} lists {len(members)} controls, more than the {budget[0]} left "
            f"of the {MAX_CONTROLS} polca examines over all chassis"
        )
        raise ReadingRejectedError(msg, reason="oversized")
    budget[0] -= len(members)
    found: list[_Candidate] = []
    for member in members:
        try:
            doc = check_type(await session.get(member), "Control", what=member)
        except ReadingRejectedError:
            continue  # unreadable, or not a Control: never a candidate, never written
        if doc.get("ControlType") == "Power" and "SetPoint" in doc:
            sensor = doc.get("Sensor")
            source = _text(sensor.get("DataSourceUri")) if isinstance(sensor, Mapping) else None
            found.append(
                _Candidate(
                    member, _text(doc.get("PhysicalContext")), _text(doc.get("SetPointUnits")),
                    source,
                )
            )  # fmt: skip
    if not found:
        return None
    chosen, why, seen = await _choose(session, chassis, path, found, named)
    if chosen is None:
        return None
    if chosen.units is not None and chosen.units not in UNITS_W:
        msg = (
            f"{chosen.path}: SetPointUnits {chosen.units!r} is not W, mW or kW; polca will "
            "not guess the unit of the node's power limit"
        )
        raise ReadingRejectedError(msg, reason="unsupported")
    return PowerControlShape(
        chassis=path,
        control=chosen.path,
        kind="controls",
        w_per_unit=UNITS_W[chosen.units or "W"],
        seen=tuple(
            SeenControl(c.path, c.context, c.units, c is chosen, why if c is chosen else note)
            for c, note in seen
        ),
    )


async def _choose(
    session: RedfishSession,
    chassis: Mapping[str, Any],
    path: str,
    found: list[_Candidate],
    named: str | None,
) -> tuple[_Candidate | None, str, list[tuple[_Candidate, str]]]:
    """The control that caps the node among a chassis's power controls, why, and a note
    on each of them (why it was not taken)."""
    if named is not None:
        want = named.rstrip("/")  # the paths found have no trailing slash
        match = [c for c in found if c.path == want or c.path.endswith("/" + want)]
        others = [(c, "" if c in match[:1] else "not the configured control") for c in found]
        return (match[0], "the configured control", others) if match else (None, "", others)
    components = [c for c in found if c.context is not None and c.context not in NODE_CONTEXTS]
    node = [c for c in found if c.context in NODE_CONTEXTS]
    unknown = [c for c in found if c.context is None]
    notes = {
        c.path: f"a component's control (PhysicalContext {c.context}), never the node's cap"
        for c in components
    }
    pool, rule = (node, "its PhysicalContext is the whole node's") if node else (unknown, "")
    if len(pool) > 1:
        total = await _total_power_sensor(session, chassis, path)
        by_sensor = [c for c in pool if total is not None and c.sensor == total]
        if len(by_sensor) == 1:
            pool, rule = by_sensor, f"its sensor is the chassis's total power ({total})"
    if len(pool) > 1:
        names = ", ".join(c.path for c in pool)
        msg = (
            f"{path}: {len(pool)} power controls could cap this node and none is marked as "
            f"the whole node's ({names}); name one in the configuration (bmc.nodes.NODE."
            "control, or polca bmc --control)"
        )
        raise ConfigError(msg)
    if not pool:
        return None, "", [(c, notes[c.path]) for c in found]
    chosen = pool[0]
    if not rule:
        rule = "the chassis's only power control that is not a component's"
    for c in found:
        if c is not chosen and c.path not in notes:
            notes[c.path] = "another control was marked as the whole node's"
    return chosen, rule, [(c, notes.get(c.path, "")) for c in found]


async def _total_power_sensor(
    session: RedfishSession, chassis: Mapping[str, Any], path: str
) -> str | None:
    """The sensor of the chassis's total power (``EnvironmentMetrics.PowerWatts``)."""
    try:
        metrics_path = odata_link(chassis, "EnvironmentMetrics", what=path)
        if metrics_path is None:
            return None
        metrics = check_type(
            await session.get(metrics_path), "EnvironmentMetrics", what=metrics_path
        )
    except ReadingRejectedError:
        return None  # no usable total: the candidates stay as ambiguous as they were
    watts = metrics.get("PowerWatts")
    return _text(watts.get("DataSourceUri")) if isinstance(watts, Mapping) else None


async def _legacy_shape(
    session: RedfishSession, chassis: Mapping[str, Any], path: str
) -> PowerControlShape | None:
    power_path = odata_link(chassis, "Power", what=path)
    if power_path is None:
        return None
    _power_control(await session.get(power_path), what=power_path)
    return PowerControlShape(chassis=path, control=power_path, kind="legacy")


def _power_control(doc: Mapping[str, Any], *, what: str) -> Mapping[str, Any]:
    """``PowerControl[0]`` of a ``Power`` resource with its ``PowerLimit`` object, else
    ``ReadingRejectedError``."""
    controls = check_type(doc, "Power", what=what).get("PowerControl")
    first = controls[0] if isinstance(controls, list) and controls else None
    if not isinstance(first, Mapping) or not isinstance(first.get("PowerLimit"), Mapping):
        msg = f"{what}: no PowerControl[0].PowerLimit"
        raise ReadingRejectedError(msg, reason="unsupported")
    return first


def _allowable(value: object, *, what: str) -> tuple[float, float] | None:
    """The range of a ``@Redfish.AllowableNumbers`` list (``"a"``, ``"a:b"``, ``"a:s:b"``)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > _MAX_ALLOWABLE:
        msg = f"{what}: AllowableNumbers is not a short list"
        raise ReadingRejectedError(msg, reason="malformed")
    lows, highs = [], []
    for item in value:
        parts = item.split(":") if isinstance(item, str) else []
        if len(parts) not in {1, 2, 3}:
            msg = f"{what}: AllowableNumbers entry {str(item)[:40]!r}"
            raise ReadingRejectedError(msg, reason="malformed")
        try:
            numbers = [float(part) for part in parts]
        except ValueError as exc:
            msg = f"{what}: AllowableNumbers entry {str(item)[:40]!r}"
            raise ReadingRejectedError(msg, reason="type") from exc
        lows.append(checked_number(numbers[0], what=what, low=0.0, high=MAX_NODE_POWER_W))
        highs.append(checked_number(numbers[-1], what=what, low=0.0, high=MAX_NODE_POWER_W))
    return min(lows), max(highs)


class BmcPowerControl:
    """Read, cap and restore one node's power limit through its BMC (no I/O here)."""

    def __init__(
        self,
        session: RedfishSession,
        *,
        shape: PowerControlShape | None = None,
        chassis_id: str | None = None,
        control: str | None = None,
    ) -> None:
        """Control the BMC behind ``session``; ``shape`` skips discovery when known;
        ``chassis_id`` picks one chassis of a service that serves several, ``control`` one
        power control of a chassis that has several."""
        self._session = session
        self._shape = shape
        self._chassis_id = chassis_id
        self._control = control

    async def discover(self) -> PowerControlShape:
        """The power control, discovered on the first call and kept."""
        if self._shape is None:
            self._shape = await discover(
                self._session, chassis_id=self._chassis_id, control=self._control
            )
        return self._shape

    async def read(self) -> BmcReading:
        """The node's power draw, limit and allowable range now."""
        shape = await self.discover()
        doc = await self._session.get(shape.control)
        if shape.kind == "controls":
            return await self._read_control(doc, shape.control, shape.w_per_unit)
        return self._read_legacy(doc, shape.control)

    async def _read_control(
        self, doc: Mapping[str, Any], path: str, w_per_unit: float
    ) -> BmcReading:
        if check_type(doc, "Control", what=path).get("ControlType") != "Power":
            msg = f"{path}: no longer a power control"
            raise ReadingRejectedError(msg, reason="malformed")
        if UNITS_W.get(_text(doc.get("SetPointUnits")) or "W") != w_per_unit:
            msg = f"{path}: SetPointUnits changed since discovery"
            raise ReadingRejectedError(msg, reason="malformed")
        sensor = doc.get("Sensor")
        power: object = None
        if isinstance(sensor, Mapping):
            power = sensor.get("Reading")
            # The excerpt's reading, else the sensor it names (DataSourceUri or a link).
            source = sensor.get("DataSourceUri") or sensor.get("@odata.id")
            if power is None and source is not None:
                where = resource_path(source, what=f"{path} Sensor.DataSourceUri")
                power = check_type(await self._session.get(where), "Sensor", what=where).get(
                    "Reading"
                )
        return _reading(
            power=_watts(power, what=f"{path} Sensor.Reading"),
            limit=_scaled(doc.get("SetPoint"), w_per_unit, what=f"{path} SetPoint"),
            low=_scaled(doc.get("AllowableMin"), w_per_unit, what=f"{path} AllowableMin"),
            high=_scaled(doc.get("AllowableMax"), w_per_unit, what=f"{path} AllowableMax"),
            path=path,
        )

    def _read_legacy(self, doc: Mapping[str, Any], path: str) -> BmcReading:
        control = _power_control(doc, what=path)
        limit_doc: Mapping[str, Any] = control["PowerLimit"]
        where = f"{path} PowerControl[0]"
        capacity = _watts(control.get("PowerCapacityWatts"), what=f"{where}.PowerCapacityWatts")
        allowable = _allowable(
            limit_doc.get("LimitInWatts@Redfish.AllowableNumbers"), what=f"{where}.PowerLimit"
        )
        low, high = allowable if allowable is not None else (0.0, capacity)
        return _reading(
            power=_watts(control.get("PowerConsumedWatts"), what=f"{where}.PowerConsumedWatts"),
            limit=_watts(limit_doc.get("LimitInWatts"), what=f"{where}.LimitInWatts"),
            low=low,
            high=high,
            path=path,
        )

    async def cap(self, watts: float) -> CapResult:
        """Limit the node to ``watts``, then read the limit back.

        ``ConfigError`` (nothing written) when ``watts`` is not finite, the allowable
        range is unknown, or ``watts`` lies outside it.
        """
        reading = await self.read()
        low, high = reading.limit_min_w, reading.limit_max_w
        if not math.isfinite(watts):
            msg = f"{reading.control}: cannot cap to {watts} W"
            raise ConfigError(msg)
        if low is None or high is None:
            msg = f"{reading.control}: the BMC gives no allowable range; not capping"
            raise ConfigError(msg)
        if not low <= watts <= high:
            msg = f"{reading.control}: {watts:g} W is outside the allowable {low:g}..{high:g} W"
            raise ConfigError(msg)
        return await self._write(watts)

    async def restore(self) -> CapResult:
        """Lift polca's cap: the limit to the allowable maximum, then read it back.

        The legacy shape without a known maximum gets ``LimitInWatts: null`` (no limit).
        ``ConfigError`` when a control gives no maximum.
        """
        reading = await self.read()
        shape = await self.discover()
        if reading.limit_max_w is None and shape.kind == "controls":
            msg = f"{reading.control}: the BMC gives no AllowableMax to restore to"
            raise ConfigError(msg)
        return await self._write(reading.limit_max_w)

    async def _write(self, watts: float | None) -> CapResult:
        shape = await self.discover()
        if shape.kind == "controls":
            # In the control's own unit (mW, kW); whole units where the unit is W or coarser.
            body: dict[str, Any] = {
                "SetPoint": None if watts is None else _in_units(watts, shape.w_per_unit)
            }
        else:
            body = {"PowerControl": [{"PowerLimit": {"LimitInWatts": watts}}]}
        await self._session.patch(shape.control, body)
        try:
            back = (await self.read()).limit_w
        except ReadingRejectedError:
            return CapResult(limit_w=None, verified=False)
        if watts is None or back is None:
            return CapResult(limit_w=back, verified=watts is None and back is None)
        return CapResult(
            limit_w=back, verified=read_back_ok(watts, back, tolerance=VERIFY_TOLERANCE_W)
        )


def _scaled(value: object, w_per_unit: float, *, what: str) -> float | None:
    """A control's value in its ``SetPointUnits``, as W (bounds checked in W)."""
    if value is None:
        return None
    number = checked_number(value, what=what, low=0.0, high=MAX_NODE_POWER_W / w_per_unit)
    return number * w_per_unit


def _in_units(watts: float, w_per_unit: float) -> float:
    """``watts`` in a control's unit: an integer count of mW, W as given, kW as given."""
    value = watts / w_per_unit
    return float(round(value)) if w_per_unit < 1.0 else value


def _reading(
    *,
    power: float | None,
    limit: float | None,
    low: float | None,
    high: float | None,
    path: str,
) -> BmcReading:
    if low is not None and high is not None and low > high:
        msg = f"{path}: allowable minimum {low:g} W above the maximum {high:g} W"
        raise ReadingRejectedError(msg, reason="absurd")
    return BmcReading(power_w=power, limit_w=limit, limit_min_w=low, limit_max_w=high, control=path)
