"""Power-limit control of one node through its BMC's Redfish service (pure of HTTP).

``BmcPowerControl`` reads, caps and restores a node's power limit through a
``RedfishSession`` (``polca.redfish.client`` is the HTTP one); it never speaks HTTP itself.

Discovery, once per BMC (``discover``): service root -> ``Chassis`` collection -> each
chassis (at most ``MAX_CHASSIS``), looking for a power control in two shapes
(platform-facts 12.2), the first preferred on each chassis:

- ``controls``: the chassis's ``Controls`` collection, a member with
  ``ControlType: "Power"`` (``SetPoint`` W, ``AllowableMin``, ``AllowableMax``, power from
  ``Sensor.Reading`` or the sensor its ``DataSourceUri`` names);
- ``legacy``: ``Chassis/{id}/Power`` -> ``PowerControl[0]`` (``PowerLimit.LimitInWatts``,
  ``PowerConsumedWatts``, ``PowerCapacityWatts``; the allowable range from
  ``LimitInWatts@Redfish.AllowableNumbers`` when given, else 0 to ``PowerCapacityWatts``).

The chassis rule: the first chassis, in the collection's order, whose ``ChassisType`` is a
whole node or enclosure (``RackMount``, ``Enclosure``, ``StandAlone``) and that has a
power control; failing that, the first chassis with one (a sub-component such as a GPU
baseboard ``Module`` caps only part of the node). At most ``MAX_CONTROLS`` controls are
examined in all. A chassis whose resources are missing or malformed is skipped.

Every value from the BMC is untrusted: a wrong type, NaN, a negative or absurd value
(over ``MAX_NODE_POWER_W``) is ``ReadingRejectedError`` with its reason, never a crash. A cap
outside the allowable range is ``ConfigError`` and is never written. A write is verified
by reading it back: a BMC that accepts it and reports another value gives
``verified=False``, never an exception.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from polca.errors import ConfigError, ReadingRejectedError
from polca.readings import checked_number
from polca.redfish.api import RedfishSession

__all__ = [
    "MAX_CHASSIS",
    "MAX_CONTROLS",
    "MAX_NODE_POWER_W",
    "BmcPowerControl",
    "BmcReading",
    "CapResult",
    "PowerControlShape",
    "discover",
]

MAX_NODE_POWER_W: Final = 100_000.0
"""The most one node may draw or be limited to (100 kW); above is absurd."""
MAX_CHASSIS: Final = 64
"""Chassis examined at most during discovery."""
MAX_CONTROLS: Final = 64
"""Controls examined at most during discovery (over all chassis)."""
VERIFY_TOLERANCE_W: Final = 1.0
"""A read-back limit within this of the written one counts as applied."""
_NODE_TYPES: Final = frozenset({"RackMount", "Enclosure", "StandAlone"})
_MAX_ALLOWABLE: Final = 16


@dataclass(frozen=True, slots=True)
class PowerControlShape:
    """Where a BMC keeps its power limit: ``control`` is the resource path PATCHed."""

    chassis: str
    control: str
    kind: Literal["controls", "legacy"]


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


def _link(doc: Mapping[str, Any], key: str) -> str | None:
    """The ``@odata.id`` of ``doc[key]``, or None when absent or not a link."""
    value = doc.get(key)
    if isinstance(value, Mapping):
        target = value.get("@odata.id")
        if isinstance(target, str):
            return target
    return None


def _members(doc: Mapping[str, Any], *, what: str, limit: int) -> list[str]:
    """The first ``limit`` member paths of a collection."""
    members = doc.get("Members")
    if not isinstance(members, list):
        msg = f"{what}: collection without a Members list"
        raise ReadingRejectedError(msg, reason="malformed")
    paths = []
    for member in members[:limit]:
        target = member.get("@odata.id") if isinstance(member, Mapping) else None
        if isinstance(target, str):
            paths.append(target)
    return paths


def _watts(value: object, *, what: str) -> float | None:
    """A power in W from the BMC, None when it gives none (absent or null)."""
    if value is None:
        return None
    return checked_number(value, what=what, low=0.0, high=MAX_NODE_POWER_W)


async def discover(session: RedfishSession, *, chassis_id: str | None = None) -> PowerControlShape:
    """The BMC's power control, by the chassis rule in the module's docstring.

    ``chassis_id`` names the chassis to use (an enclosure manager serving several nodes):
    only the chassis whose path ends in it is considered. Raises ``ReadingRejectedError``
    (``unsupported``) when no chassis has one, ``malformed`` when the service root or the
    chassis collection is not what Redfish promises.
    """
    root = await session.get("/redfish/v1")
    chassis_path = _link(root, "Chassis")
    if chassis_path is None:
        msg = "service root has no Chassis collection"
        raise ReadingRejectedError(msg, reason="unsupported")
    chassis_list = _members(await session.get(chassis_path), what=chassis_path, limit=MAX_CHASSIS)
    budget = [MAX_CONTROLS]
    fallback: PowerControlShape | None = None
    if chassis_id is not None:
        chassis_list = [p for p in chassis_list if p.rstrip("/").rsplit("/", 1)[-1] == chassis_id]
    for path in chassis_list:
        try:
            chassis = await session.get(path)
        except ReadingRejectedError:
            continue  # a broken chassis: look at the others
        shape = None
        with contextlib.suppress(ReadingRejectedError):  # broken Controls: try the legacy shape
            shape = await _controls_shape(session, chassis, path, budget)
        if shape is None:
            with contextlib.suppress(ReadingRejectedError):
                shape = await _legacy_shape(session, chassis, path)
        if shape is None:
            continue
        if chassis.get("ChassisType") in _NODE_TYPES:
            return shape
        if fallback is None:
            fallback = shape
    if fallback is not None:
        return fallback
    msg = f"no power control on any of {len(chassis_list)} chassis"
    raise ReadingRejectedError(msg, reason="unsupported")


async def _controls_shape(
    session: RedfishSession, chassis: Mapping[str, Any], path: str, budget: list[int]
) -> PowerControlShape | None:
    controls_path = _link(chassis, "Controls")
    if controls_path is None or budget[0] <= 0:
        return None
    members = _members(await session.get(controls_path), what=controls_path, limit=budget[0])
    for member in members:
        budget[0] -= 1
        try:
            control = await session.get(member)
        except ReadingRejectedError:
            continue
        if control.get("ControlType") == "Power" and "SetPoint" in control:
            return PowerControlShape(chassis=path, control=member, kind="controls")
    return None


async def _legacy_shape(
    session: RedfishSession, chassis: Mapping[str, Any], path: str
) -> PowerControlShape | None:
    power_path = _link(chassis, "Power")
    if power_path is None:
        return None
    _power_control(await session.get(power_path), what=power_path)
    return PowerControlShape(chassis=path, control=power_path, kind="legacy")


def _power_control(doc: Mapping[str, Any], *, what: str) -> Mapping[str, Any]:
    """``PowerControl[0]`` with its ``PowerLimit`` object, else ``ReadingRejectedError``."""
    controls = doc.get("PowerControl")
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
    ) -> None:
        """Control the BMC behind ``session``; ``shape`` skips discovery when known;
        ``chassis_id`` picks one chassis of a service that serves several."""
        self._session = session
        self._shape = shape
        self._chassis_id = chassis_id

    async def discover(self) -> PowerControlShape:
        """The power control, discovered on the first call and kept."""
        if self._shape is None:
            self._shape = await discover(self._session, chassis_id=self._chassis_id)
        return self._shape

    async def read(self) -> BmcReading:
        """The node's power draw, limit and allowable range now."""
        shape = await self.discover()
        doc = await self._session.get(shape.control)
        if shape.kind == "controls":
            return await self._read_control(doc, shape.control)
        return self._read_legacy(doc, shape.control)

    async def _read_control(self, doc: Mapping[str, Any], path: str) -> BmcReading:
        if doc.get("ControlType") != "Power":
            msg = f"{path}: no longer a power control"
            raise ReadingRejectedError(msg, reason="malformed")
        sensor = doc.get("Sensor")
        power: object = None
        if isinstance(sensor, Mapping):
            power = sensor.get("Reading")
            # The excerpt's reading, else the sensor it names (DataSourceUri or a link).
            source = sensor.get("DataSourceUri") or sensor.get("@odata.id")
            if power is None and isinstance(source, str):
                power = (await self._session.get(source)).get("Reading")
        return _reading(
            power=_watts(power, what=f"{path} Sensor.Reading"),
            limit=_watts(doc.get("SetPoint"), what=f"{path} SetPoint"),
            low=_watts(doc.get("AllowableMin"), what=f"{path} AllowableMin"),
            high=_watts(doc.get("AllowableMax"), what=f"{path} AllowableMax"),
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
            body: dict[str, Any] = {"SetPoint": watts}
        else:
            body = {"PowerControl": [{"PowerLimit": {"LimitInWatts": watts}}]}
        await self._session.patch(shape.control, body)
        try:
            back = (await self.read()).limit_w
        except ReadingRejectedError:
            return CapResult(limit_w=None, verified=False)
        if watts is None or back is None:
            return CapResult(limit_w=back, verified=watts is None and back is None)
        return CapResult(limit_w=back, verified=abs(back - watts) <= VERIFY_TOLERANCE_W)


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
