"""Row power from a Redfish PDU or chassis: ``RedfishMeterSource`` and ``polca meter probe``.

Why it exists: rack PDUs and some switchboards publish their power over Redfish
(``PowerEquipment/RackPDUs/{id}``, DSP0268 ``PowerDistribution``), other gear on a
``Chassis``. The source finds the resources once (service root -> ``PowerEquipment`` ->
``RackPDUs`` -> the configured PDU, or the first -> its ``Mains`` or ``Branches``; or
``Chassis/{id}`` -> ``EnvironmentMetrics``, a power ``Sensor``, the power supplies of its
``PowerSubsystem``, or the deprecated ``Power``) and each ``read()`` then GETs only those
resources and sums them with the pure readers of ``polca.redfish.power``: a PDU fed by an
A and a B main reports the sum of both.

The circuits a source reads also say what they do with their feed, from the same
documents (no other request): the reading's ``equipment`` is their ``circuit_state``
(``BreakerState``, ``PowerState``) when they all agree, else ``unknown`` (a source summing
an A main that is up and a B main that tripped cannot speak for one feed: give each main
its own source, ``circuits: [AC1]``), and ``input_voltage_v`` the lowest ``Voltage``
reading among them. A chassis' power (``EnvironmentMetrics``, a ``Sensor``, its supplies)
says nothing of a feed: ``unknown``.

How it fails (``polca.meter.source``): the service unreachable, timing out or answering
5xx: ``TransportError``, after which the session is dropped and the next read reconnects
(and discovers again); rejected credentials: ``TransportAuthError``. Values that cannot
be used: ``ReadingRejectedError`` (a 404 on a discovered path also forgets the discovery). A
configuration that does not fit the service (no such PDU, circuit or chassis; more than
``MAX_CIRCUITS`` circuits): ``ConfigError``. Nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polca.errors import ConfigError, ReadingRejectedError, TransportError
from polca.meter.source import SourceReading
from polca.readings import EquipmentState
from polca.redfish import open_session
from polca.redfish.api import RedfishEndpoint, RedfishSession, SessionFactory
from polca.redfish.documents import (
    as_object,
    check_type,
    excerpt_reading,
    member_links,
    odata_link,
)
from polca.redfish.power import (
    PowerReading,
    circuit_power,
    circuit_state,
    environment_power,
    legacy_power,
    power_supply_power,
    sensor_power,
    sum_readings,
)

__all__ = ["MAX_CIRCUITS", "RedfishMeterConfig", "RedfishMeterSource", "probe"]

MAX_CIRCUITS = 64
"""Most circuits (mains or branches) one source sums."""
_MAX_MEMBERS = 256  # members of a collection looked at during discovery
_MAX_VOLTAGE_V = 100_000.0  # a feeder's or a switchboard's circuit, not only a rack PDU's
_ID = r"^[A-Za-z0-9_.:-]{1,128}$"

Kind = Literal["circuits", "environment", "sensor", "supplies", "legacy"]


class RedfishMeterConfig(BaseModel):
    """One power source read over Redfish."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Literal["redfish"] = Field(description="Selects this source type.")
    name: str = Field(pattern=_ID, description="The source's name, unique within its row.")
    endpoint: RedfishEndpoint = Field(description="The Redfish service.")
    resource: Literal["mains", "circuits", "chassis"] = Field(
        "mains",
        description="mains: the PDU's inlets, summed; circuits: its branches (all, or "
        "`circuits`); chassis: a chassis' power.",
    )
    pdu: str | None = Field(
        None, pattern=_ID, description="RackPDU id; default: the only (else the first) PDU."
    )
    circuits: tuple[str, ...] | None = Field(
        None,
        max_length=MAX_CIRCUITS,
        description="Branch (or main) ids to sum; default: all of them.",
    )
    chassis: str | None = Field(
        None, pattern=_ID, description="Chassis id, for resource: chassis (required there)."
    )
    power_factor: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Used only for circuits reporting current and voltage but no power.",
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    kind: Kind
    paths: tuple[str, ...]
    where: str  # what was found, for details
    skipped: tuple[str, ...] = ()


def _last(path: str) -> str:
    return path.rsplit("/", 1)[-1]


async def _get(session: RedfishSession, path: str) -> Mapping[str, Any]:
    return await session.get(path)


async def _discover_circuits(session: RedfishSession, config: RedfishMeterConfig) -> _Plan:
    root = check_type(await _get(session, "/redfish/v1"), "ServiceRoot", what="service root")
    equipment_path = odata_link(root, "PowerEquipment", what="service root")
    if equipment_path is None:
        msg = f"{config.endpoint.url} has no PowerEquipment: not a Redfish PDU"
        raise ConfigError(msg)
    equipment = as_object(await _get(session, equipment_path), what=equipment_path)
    pdus_path = odata_link(equipment, "RackPDUs", what=equipment_path)
    if pdus_path is None:
        msg = f"{config.endpoint.url}: PowerEquipment lists no RackPDUs"
        raise ConfigError(msg)
    pdus = member_links(await _get(session, pdus_path), what=pdus_path, limit=_MAX_MEMBERS)
    if config.pdu is not None:
        pdu_path = next((p for p in pdus if _last(p) == config.pdu), None)
        if pdu_path is None:
            ids = [_last(p) for p in pdus]
            msg = f"{config.endpoint.url} has no RackPDU {config.pdu!r} (it has {ids})"
            raise ConfigError(msg)
    elif pdus:
        pdu_path = pdus[0]
    else:
        msg = f"{config.endpoint.url}: no RackPDUs"
        raise ConfigError(msg)
    pdu = check_type(await _get(session, pdu_path), "PowerDistribution", what=pdu_path)
    key = "Mains" if config.resource == "mains" else "Branches"
    circuits_path = odata_link(pdu, key, what=pdu_path)
    if circuits_path is None:
        msg = f"{pdu_path} has no {key}"
        raise ConfigError(msg)
    members = member_links(
        await _get(session, circuits_path), what=circuits_path, limit=_MAX_MEMBERS
    )
    if config.circuits is not None:
        by_id = {_last(p): p for p in members}
        missing = [c for c in config.circuits if c not in by_id]
        if missing:
            msg = f"{circuits_path} has no {missing} (it has {sorted(by_id)})"
            raise ConfigError(msg)
        members = tuple(by_id[c] for c in config.circuits)
    if not members:
        msg = f"{circuits_path} is empty"
        raise ConfigError(msg)
    if len(members) > MAX_CIRCUITS:
        msg = (
            f"{circuits_path} has {len(members)} circuits; list at most {MAX_CIRCUITS} in circuits"
        )
        raise ConfigError(msg)
    return _Plan("circuits", members, f"PDU {_last(pdu_path)} {key.lower()}")


async def _discover_chassis(session: RedfishSession, config: RedfishMeterConfig) -> _Plan:
    if config.chassis is None:
        msg = f"source {config.name}: resource chassis needs a chassis id"
        raise ConfigError(msg)
    path = f"/redfish/v1/Chassis/{config.chassis}"
    try:
        chassis = check_type(await _get(session, path), "Chassis", what=path)
    except ReadingRejectedError as exc:
        if exc.reason != "not_found":
            raise
        msg = f"{config.endpoint.url} has no chassis {config.chassis!r}"
        raise ConfigError(msg) from exc
    skipped: list[str] = []
    env_path = odata_link(chassis, "EnvironmentMetrics", what=path)
    if env_path is not None:
        try:
            environment_power(await _get(session, env_path), what=env_path)
            return _Plan("environment", (env_path,), f"chassis {config.chassis}")
        except ReadingRejectedError as exc:
            skipped.append(f"EnvironmentMetrics: {exc}")
    sensors_path = odata_link(chassis, "Sensors", what=path)
    if sensors_path is not None:
        found: list[tuple[str, object]] = []
        for sensor_path in member_links(
            await _get(session, sensors_path), what=sensors_path, limit=_MAX_MEMBERS
        ):
            doc = await _get(session, sensor_path)
            if doc.get("ReadingType") == "Power":
                found.append((sensor_path, doc.get("PhysicalContext")))
        chosen = [p for p, ctx in found if ctx == "Chassis"] or [p for p, _ in found]
        if len(chosen) == 1:
            return _Plan("sensor", (chosen[0],), f"chassis {config.chassis}", tuple(skipped))
        skipped.append(f"Sensors: {len(chosen)} power sensors, none for the chassis as a whole")
    subsystem_path = odata_link(chassis, "PowerSubsystem", what=path)
    if subsystem_path is not None:
        subsystem = check_type(
            await _get(session, subsystem_path), "PowerSubsystem", what=subsystem_path
        )
        supplies_path = odata_link(subsystem, "PowerSupplies", what=subsystem_path)
        metrics: list[str] = []
        if supplies_path is not None:
            for supply_path in member_links(
                await _get(session, supplies_path), what=supplies_path, limit=MAX_CIRCUITS
            ):
                supply = check_type(
                    await _get(session, supply_path), "PowerSupply", what=supply_path
                )
                metrics_path = odata_link(supply, "Metrics", what=supply_path)
                if metrics_path is not None:
                    metrics.append(metrics_path)
        if metrics:
            return _Plan("supplies", tuple(metrics), f"chassis {config.chassis}", tuple(skipped))
        skipped.append("PowerSubsystem: no power supply metrics")
    legacy_path = odata_link(chassis, "Power", what=path)
    if legacy_path is not None:
        return _Plan("legacy", (legacy_path,), f"chassis {config.chassis}", tuple(skipped))
    msg = (
        f"chassis {config.chassis} reports no power ({'; '.join(skipped) or 'no power resources'})"
    )
    raise ConfigError(msg)


def _reading(
    plan: _Plan, docs: list[Mapping[str, Any]], power_factor: float | None
) -> PowerReading:
    if plan.kind == "circuits":
        readings = [
            circuit_power(doc, power_factor=power_factor, what=_last(path))
            for path, doc in zip(plan.paths, docs, strict=True)
        ]
        return sum_readings(readings, what=plan.where)
    if plan.kind == "environment":
        reading = environment_power(docs[0], what=f"{plan.where} EnvironmentMetrics")
    elif plan.kind == "sensor":
        reading = sensor_power(docs[0], what=f"{plan.where} sensor {_last(plan.paths[0])}")
    elif plan.kind == "supplies":
        reading = power_supply_power(docs, what=f"{plan.where} power supplies")
    else:
        reading = legacy_power(docs[0], what=f"{plan.where} Power")
    return PowerReading(
        reading.power_w, reading.detail, reading.energy_j, plan.skipped + reading.fallbacks
    )


def _feed(plan: _Plan, docs: list[Mapping[str, Any]]) -> tuple[EquipmentState, float | None]:
    """What a plan's circuits say of their feed, and its lowest voltage (module docstring).

    ``ReadingRejectedError`` for a voltage that is there but not a sane number; a null
    one (a reading the PDU does not have now) is None.
    """
    if plan.kind != "circuits":
        return "unknown", None
    states: set[EquipmentState] = set()
    volts: list[float] = []
    for path, doc in zip(plan.paths, docs, strict=True):
        states.add(circuit_state(doc, what=_last(path)))
        try:
            voltage_v = excerpt_reading(doc, "Voltage", low=0.0, high=_MAX_VOLTAGE_V)
        except ReadingRejectedError as exc:
            if exc.reason != "unsupported":
                raise
            voltage_v = None
        if voltage_v is not None:
            volts.append(voltage_v)
    equipment: EquipmentState = states.pop() if len(states) == 1 else "unknown"
    return equipment, min(volts, default=None)


class RedfishMeterSource:
    """A ``MeterSource`` over one Redfish service (see the module docstring)."""

    def __init__(
        self,
        config: RedfishMeterConfig,
        *,
        session_factory: SessionFactory | None = None,
        password: str | None = None,
    ) -> None:
        """Prepare reading ``config``'s device; no I/O (the first ``read()`` connects)."""
        self.config = config
        self._factory: SessionFactory = session_factory or open_session
        self._password = password
        self._session: RedfishSession | None = None
        self._plan: _Plan | None = None
        self.connects = 0
        """Sessions opened."""
        self.discoveries = 0
        """Times the resources were discovered."""

    @property
    def name(self) -> str:
        """The source's configured name."""
        return self.config.name

    @property
    def resources(self) -> tuple[str, ...]:
        """The paths each read GETs (empty before the first read)."""
        return self._plan.paths if self._plan is not None else ()

    async def read(self) -> SourceReading:
        """GET the discovered resources once and sum them (see the module docstring)."""
        try:
            if self._session is None:
                self._session = await self._factory(self.config.endpoint, password=self._password)
                self.connects += 1
            session = self._session
            if self._plan is None:
                self._plan = await (
                    _discover_chassis(session, self.config)
                    if self.config.resource == "chassis"
                    else _discover_circuits(session, self.config)
                )
                self.discoveries += 1
            plan = self._plan
            docs = [await session.get(path) for path in plan.paths]
        except TransportError:
            await self.close()  # reconnect (and discover again) at the next read
            raise
        except ReadingRejectedError as exc:
            if exc.reason == "not_found":
                self._plan = None
            raise
        reading = _reading(plan, docs, self.config.power_factor)
        equipment, voltage_v = _feed(plan, docs)
        return SourceReading(
            reading.power_w,
            reading.detail,
            reading.energy_j,
            reading.fallbacks,
            equipment=equipment,
            input_voltage_v=voltage_v,
        )

    async def close(self) -> None:
        """Close the session (idempotent); the next read reconnects and discovers again."""
        session, self._session = self._session, None
        self._plan = None
        if session is not None:
            # The service may be gone; its session then times out there.
            with contextlib.suppress(TransportError, ReadingRejectedError):
                await session.close()


async def probe(
    url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    session_factory: SessionFactory | None = None,
    verify_tls: bool = True,
    ca_file: Path | None = None,
    timeout_s: float = 5.0,
) -> dict[str, Any]:
    """Walk a Redfish service from its root and report its power (``polca meter probe``).

    Tries the first PDU's mains, then each chassis (up to 16): the first that yields a
    power wins. Returns ``{"power_w", "source", "detail", "resources", "energy_j",
    "fallbacks", "skipped"}``; raises ``ConfigError`` when nothing yields a power, and
    ``TransportError`` when the service cannot be reached.
    """
    try:
        endpoint = RedfishEndpoint(
            url=url.rstrip("/"),
            username=username,
            allow_http=url.startswith("http://"),
            verify_tls=verify_tls,
            ca_file=ca_file,
            timeout_s=timeout_s,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        msg = f"bad Redfish URL {url!r}: use https://host[:port] (http:// in labs)"
        raise ConfigError(msg) from exc
    factory = session_factory or open_session
    session = await factory(endpoint, password=password)
    skipped: list[str] = []
    try:
        attempts: list[tuple[str, Callable[[], Awaitable[_Plan]]]] = []
        mains = RedfishMeterConfig(protocol="redfish", name="probe", endpoint=endpoint)
        attempts.append(("mains", lambda: _discover_circuits(session, mains)))
        root = check_type(await session.get("/redfish/v1"), "ServiceRoot", what="service root")
        chassis_path = odata_link(root, "Chassis", what="service root")
        if chassis_path is not None:
            for path in member_links(await session.get(chassis_path), what=chassis_path, limit=16):
                config = mains.model_copy(update={"resource": "chassis", "chassis": _last(path)})
                attempts.append((f"chassis {_last(path)}", _bind(session, config)))
        for source, discover in attempts:
            try:
                plan = await discover()
                docs = [await session.get(p) for p in plan.paths]
                reading = _reading(plan, docs, None)
            except (ConfigError, ReadingRejectedError) as exc:
                skipped.append(f"{source}: {exc}")
                continue
            return {
                "power_w": reading.power_w,
                "source": source,
                "detail": reading.detail,
                "resources": list(plan.paths),
                "energy_j": reading.energy_j,
                "fallbacks": list(reading.fallbacks),
                "skipped": skipped,
            }
    finally:
        await session.close()
    msg = f"{url} reports no usable power: {'; '.join(skipped) or 'no PDU or chassis'}"
    raise ConfigError(msg)


def _bind(session: RedfishSession, config: RedfishMeterConfig) -> Callable[[], Awaitable[_Plan]]:
    return lambda: _discover_chassis(session, config)
