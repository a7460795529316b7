"""Poll a CDU over Redfish: ``RedfishCduPoller``, the Redfish twin of ``ModbusCduPoller``.

Why it exists: CDUs that follow the OCP/DMTF liquid cooling profiles describe themselves
as a Redfish ``CoolingUnit``. The poller finds the CDU once (service root ->
``ThermalEquipment`` -> ``CDUs`` -> the configured ``cdu_id``, or the only one) and the
resources it links (coolant connectors, pumps, leak detection and its detectors, filters,
environment metrics); each ``poll()`` then GETs exactly those and has the pure reader
(``polca.redfish.cooling``) build the ``CduTelemetry``, which ``run_poller``
(``polca.cdu.publisher``) publishes like any CDU's telemetry. The leak detection is
read first in each poll, so a leak is published at the next poll, as on the Modbus path.

How it fails (the same contract as ``ModbusCduPoller``):

- Reconnection lives outside the client: a poll that cannot connect, times out or gets
  an answer it cannot use (a 5xx, a 404 on a discovered path, a body that is not a
  ``CoolingUnit``) drops the session and raises ``TransportError`` with ``delay_s``;
  polls during the jittered, exponential backoff that follows raise at once, without
  touching the network. After a failure the CDU is discovered again.
- An outage is logged once (``redfish_cdu_unreachable``, warning) and its end once
  (``redfish_cdu_recovered``, info, with its length); the failed polls between are debug.
- Rejected credentials (``TransportAuthError``) and a configuration that does not fit the
  service (no ``ThermalEquipment``, no such CDU, several CDUs and no ``cdu_id``; a
  password that cannot be read) are fatal: retrying cannot help.
- A value that cannot be used is left out (states take their conservative value), counted
  (``invalid_values``) and logged once until it is good again (``redfish_value_invalid``,
  ``redfish_value_valid``); filters whose health is not OK are logged when that changes.

What it must not do: speak HTTP (``polca.redfish.client`` does), publish, or sleep
between polls.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from pydantic import BaseModel, ConfigDict, Field

from polca.cdu.outage import Outage
from polca.errors import ConfigError, FatalError, ReadingRejectedError, TransportError
from polca.redfish import open_session
from polca.redfish.api import RedfishEndpoint, RedfishSession, SessionFactory
from polca.redfish.cooling import (
    MAX_CONNECTORS,
    MAX_FILTERS,
    CduDocuments,
    CduReading,
    read_cooling_unit,
)
from polca.redfish.documents import as_object, check_type, member_links, odata_link

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from polca.telemetry.schema import CduTelemetry

__all__ = ["RedfishCduConfig", "RedfishCduPoller"]

_NAME = r"^[A-Za-z0-9_.:-]+$"
_MAX_CDUS = 64  # members of ThermalEquipment/CDUs looked at
_MAX_DETECTORS = 64


class RedfishCduConfig(BaseModel):
    """One CDU reached over Redfish."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cdu: str = Field(
        pattern=_NAME, max_length=128, description="CDU name: the topic segment and `cdu` field."
    )
    loop: str = Field(pattern=_NAME, max_length=128, description="The cooling loop the CDU serves.")
    endpoint: RedfishEndpoint = Field(description="The Redfish service of the CDU.")
    cdu_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        max_length=128,
        description="Id of the CoolingUnit under ThermalEquipment/CDUs; default: the only one.",
    )
    reconnect_min_s: float = Field(
        0.5, ge=0, description="First reconnect delay; doubles per failure, with jitter."
    )
    reconnect_max_s: float = Field(30.0, ge=0, description="Largest reconnect delay.")


@dataclass(frozen=True, slots=True)
class _Plan:
    """The paths one poll GETs, found once by discovery."""

    unit: str
    leak_detection: str | None
    leak_detectors: tuple[str, ...]
    secondary: tuple[str, ...]
    primary: tuple[str, ...]
    pumps: tuple[str, ...]
    filters: tuple[str, ...]
    environment: str | None

    @property
    def requests(self) -> int:
        return (
            1
            + (self.leak_detection is not None)
            + len(self.leak_detectors)
            + len(self.secondary)
            + len(self.primary)
            + len(self.pumps)
            + len(self.filters)
            + (self.environment is not None)
        )


class RedfishCduPoller:
    """Polls one CDU over Redfish and turns its ``CoolingUnit`` into ``CduTelemetry``."""

    def __init__(
        self,
        config: RedfishCduConfig,
        *,
        session_factory: SessionFactory | None = None,
        time_ns: Callable[[], int] = time.time_ns,
        rng: random.Random | None = None,
        logger: FilteringBoundLogger | None = None,
    ) -> None:
        """Prepare polling ``config``'s CDU; no I/O (the first ``poll()`` connects)."""
        self.config = config
        self.where = f"{config.endpoint.url.rstrip('/')} (CDU {config.cdu_id or 'the only one'})"
        """Where the CDU is, for logs."""
        self._factory: SessionFactory = session_factory or open_session
        self._time_ns = time_ns
        self._rng = rng
        self._log: FilteringBoundLogger = (
            logger if logger is not None else structlog.get_logger(__name__)
        ).bind(cdu=config.cdu, url=config.endpoint.url)
        self._session: RedfishSession | None = None
        self._plan: _Plan | None = None
        self._outage = Outage(
            prefix="redfish_cdu",
            log=self._log,
            min_s=config.reconnect_min_s,
            max_s=config.reconnect_max_s,
            rng=rng,
        )
        self._invalid: set[str] = set()
        self._bad_filters: dict[str, str] = {}
        self.last: CduReading | None = None
        """The last successful reading (capacity, own power and filters included)."""
        self.polls = 0
        """Successful polls."""
        self.failures = 0
        """Failed polls (each raised ``TransportError``)."""
        self.connects = 0
        """Sessions opened."""
        self.discoveries = 0
        """Times the CDU's resources were discovered."""
        self.invalid_values = 0
        """Values that could not be used, summed over polls."""

    @property
    def connected(self) -> bool:
        """Whether a session is open."""
        return self._session is not None

    @property
    def in_outage(self) -> bool:
        """Whether the last poll failed."""
        return self._outage.since is not None

    @property
    def requests_per_poll(self) -> int | None:
        """GETs of one poll, once discovered."""
        return self._plan.requests if self._plan is not None else None

    async def poll(self) -> CduTelemetry:
        """Read the CDU once; its telemetry.

        Raises ``TransportError`` (with ``delay_s`` until the next attempt) while the CDU
        cannot be read, and a ``FatalError`` (``ConfigError``, ``TransportAuthError``) when
        retrying cannot help.
        """
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None:
            wait_s = self._outage.wait_s(loop.time())
            if wait_s > 0:
                self.failures += 1
                self._outage.skipped()
                msg = f"Redfish CDU {self.config.cdu} unreachable; next attempt in {wait_s:.1f} s"
                raise TransportError(msg, delay_s=wait_s)
        try:
            if session is None:
                session = await self._factory(self.config.endpoint)
                self._session = session
                self.connects += 1
                self._log.debug("redfish_cdu_connected")
            if self._plan is None:
                self._plan = await self._discover(session)
                self.discoveries += 1
                self._log.info("redfish_cdu_discovered", requests_per_poll=self._plan.requests)
            docs = await self._fetch(session, self._plan)
            reading = read_cooling_unit(
                docs, cdu=self.config.cdu, loop=self.config.loop, ts_ns=self._time_ns()
            )
        except FatalError:
            await self._drop_session()
            raise
        except (TransportError, ReadingRejectedError) as exc:
            await self._drop_session()
            self._plan = None  # the service may have changed: discover again
            raise self._failure(exc, loop.time()) from exc
        self._note(reading)
        self._outage.recovered(loop.time())
        self.polls += 1
        self.last = reading
        return reading.telemetry

    async def close(self) -> None:
        """Close the session, if any, logging out of the service (the next poll reconnects).

        Async, unlike ``ModbusCduPoller.close``: ``run_poller`` awaits it when it is.
        """
        await self._drop_session()

    # -- discovery and fetching -------------------------------------------------------------

    async def _discover(self, session: RedfishSession) -> _Plan:
        root = check_type(await session.get("/redfish/v1"), "ServiceRoot", what="service root")
        thermal_path = odata_link(root, "ThermalEquipment", what="service root")
        if thermal_path is None:
            msg = f"{self.config.endpoint.url} has no ThermalEquipment: not a Redfish CDU"
            raise ConfigError(msg)
        thermal = as_object(await session.get(thermal_path), what=thermal_path)
        cdus_path = odata_link(thermal, "CDUs", what=thermal_path)
        if cdus_path is None:
            msg = f"{self.config.endpoint.url}: ThermalEquipment lists no CDUs"
            raise ConfigError(msg)
        members = member_links(await session.get(cdus_path), what=cdus_path, limit=_MAX_CDUS)
        ids = {path.rsplit("/", 1)[-1]: path for path in members}
        if self.config.cdu_id is not None:
            unit_path = ids.get(self.config.cdu_id)
            if unit_path is None:
                msg = (
                    f"{self.config.endpoint.url} has no CDU {self.config.cdu_id!r} "
                    f"(it has {sorted(ids)})"
                )
                raise ConfigError(msg)
        elif len(ids) == 1:
            unit_path = next(iter(ids.values()))
        else:
            msg = (
                f"{self.config.endpoint.url} has {len(ids)} CDUs {sorted(ids)}: set cdu_id "
                "to the one this process polls"
            )
            raise ConfigError(msg)
        unit = check_type(await session.get(unit_path), "CoolingUnit", what=unit_path)

        async def members_of(key: str, limit: int) -> tuple[str, ...]:
            path = odata_link(unit, key, what=unit_path)
            if path is None:
                return ()
            return member_links(await session.get(path), what=path, limit=limit)

        leak_path = odata_link(unit, "LeakDetection", what=unit_path)
        detectors: tuple[str, ...] = ()
        if leak_path is not None:
            leak = check_type(await session.get(leak_path), "LeakDetection", what=leak_path)
            groups = leak.get("LeakDetectorGroups")
            collection = odata_link(leak, "LeakDetectors", what=leak_path)
            if not groups and collection is not None:
                detectors = member_links(
                    await session.get(collection), what=collection, limit=_MAX_DETECTORS
                )
        return _Plan(
            unit=unit_path,
            leak_detection=leak_path,
            leak_detectors=detectors,
            secondary=await members_of("SecondaryCoolantConnectors", MAX_CONNECTORS),
            primary=await members_of("PrimaryCoolantConnectors", MAX_CONNECTORS),
            pumps=await members_of("Pumps", 16),
            filters=await members_of("Filters", MAX_FILTERS),
            environment=odata_link(unit, "EnvironmentMetrics", what=unit_path),
        )

    async def _fetch(self, session: RedfishSession, plan: _Plan) -> CduDocuments:
        async def each(paths: tuple[str, ...]) -> tuple[object, ...]:
            return tuple([await session.get(path) for path in paths])

        # The leak first: it is what must not wait behind a slow pump read.
        leak = await session.get(plan.leak_detection) if plan.leak_detection else None
        detectors = await each(plan.leak_detectors)
        unit = await session.get(plan.unit)
        return CduDocuments(
            unit=unit,
            secondary=await each(plan.secondary),
            primary=await each(plan.primary),
            pumps=await each(plan.pumps),
            leak_detection=leak,
            leak_detectors=detectors,
            filters=await each(plan.filters),
            environment=await session.get(plan.environment) if plan.environment else None,
        )

    # -- outage and value bookkeeping ---------------------------------------------------------

    async def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                await session.close()
            except (TransportError, ReadingRejectedError) as exc:  # the service may be gone
                self._log.debug("redfish_cdu_close_failed", error=str(exc))

    def _failure(self, exc: BaseException, now: float) -> TransportError:
        self.failures += 1
        error = str(exc) or type(exc).__name__
        reason = getattr(exc, "reason", "transport")
        delay_s = self._outage.failed(error, now, reason=reason)
        msg = f"Redfish CDU {self.config.cdu} at {self.config.endpoint.url}: {error}"
        return TransportError(msg, delay_s=delay_s)

    def _note(self, reading: CduReading) -> None:
        """Log a value when it goes bad and when it is good again; filters likewise."""
        bad: dict[str, str] = {}
        for problem in reading.problems:
            bad.setdefault(problem.field, problem.reason)
        self.invalid_values += len(reading.problems)
        for field, reason in bad.items():
            if field not in self._invalid:
                self._log.warning("redfish_value_invalid", field=field, reason=reason)
        for field in self._invalid - bad.keys():
            self._log.info("redfish_value_valid", field=field)
        self._invalid = set(bad)
        filters: dict[str, str] = {n: h for n, h in reading.filters if h != "ok"}
        for name, health in filters.items():
            if self._bad_filters.get(name) != health:
                self._log.warning("redfish_cdu_filter_unhealthy", filter=name, health=health)
        for name in self._bad_filters.keys() - filters.keys():
            self._log.info("redfish_cdu_filter_healthy", filter=name)
        self._bad_filters = filters
