"""Row power from rack PDUs over SNMP v2c or v3 (``polca meter``): the only pysnmp importer.

``SnmpSource`` reads one PDU: a GET of the profile's scalars and a bounded walk of each of
its table columns per poll, handed to ``meter/profiles.py`` ``decode`` (which says what the
values mean). With ``profile: auto`` the vendor comes from sysObjectID, read once at the
first poll and remembered. How SNMP failures map onto ``MeterSource``'s contract:

- no answer within ``timeout_s`` x (``retries`` + 1), an unreachable host, a malformed
  reply, any other pysnmp failure: ``TransportError`` (a v2c agent drops requests with a
  wrong community silently, so that is a timeout too);
- SNMPv3 credentials refused (unknown user, wrong digest, undecryptable): the subclass
  ``TransportAuthError``, fatal, since the same keys cannot succeed later; SNMPv3 privacy
  without the ``cryptography`` package: ``ConfigError``;
- error-status ``noSuchName``, ``noAccess`` or ``authorizationError`` (the agent has no
  such OID for us or its view hides it): ``ConfigError``, since the configuration does not
  fit the device; any other error-status (``genErr``, ``tooBig``): ``TransportError``, since
  the agent may answer next time.

Sources share ``SnmpEngine``s: one per event loop and set of credentials (every v2c
source shares one; v3 sources share one per user and keys, since an engine's USM table
holds one entry per user name). An engine costs a third of a second of CPU to make (its
MIB machinery) and holds one UDP socket for every PDU it talks to; one per PDU made a
meter of 200 PDUs spend its first minute building engines. The last source to close one
closes its socket.

A poll asks for as little as it can: the first read (and one every ``RELEARN_READS``)
asks for the most preferred value first (the device's total power) and for the next
(its phases, then current x voltage) only when the device does not support it; the reads
after it ask for the value found only (one GET for a PDU that measures its total power,
instead of a GET and four column walks), keeping the first read's ``fallbacks``. A read
of the learnt value that fails to decode asks again from the top at once.

A UPS (``ups: true``) also says what it does with its feed: its first GET of each read
carries ``meter/ups.py`` ``UPS_OIDS`` (output source, battery status, minutes left, load,
input voltage), decoded by ``decode_ups`` into the reading's ``equipment``, ``on_battery``,
``battery_minutes``, ``load_pct`` and ``input_voltage_v``. A device that does not answer
upsOutputSource is ``ReadingRejectedError`` (``unsupported``): its power alone would say
nothing of the feed it was configured to watch. Secrets come from files or
systemd credentials (``polca.settings.read_secret``), never from YAML. Nothing is logged
per poll: the service logs.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal, Self

from pyasn1.type import univ  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

with warnings.catch_warnings():
    # pysnmp 7.1 imports pysmi (when installed) by names pysmi 2 deprecates: one warning at
    # import, nothing to fix here; we never compile MIBs (every OID is numeric).
    warnings.filterwarnings("ignore", r".* is deprecated\. Please use ", DeprecationWarning)
    from pysnmp import error as pysnmp_error  # type: ignore[import-untyped]
    from pysnmp.hlapi.v3arch import asyncio as hlapi  # type: ignore[import-untyped]
    from pysnmp.hlapi.varbinds import CommandGeneratorVarBinds  # type: ignore[import-untyped]
    from pysnmp.proto import errind, rfc1905  # type: ignore[import-untyped]
    from pysnmp.smi import compiler  # type: ignore[import-untyped]

from polca.errors import ConfigError, ReadingRejectedError, TransportAuthError, TransportError
from polca.meter.profiles import (
    MAX_ROWS,
    MAX_VOLTAGE_V,
    MISSING,
    PROFILES,
    SYS_DESCR,
    SYS_OBJECT_ID,
    Kind,
    Profile,
    Value,
    decode,
    generic_profile,
    profile_for,
    vendor_of,
)
from polca.meter.source import SourceReading
from polca.meter.ups import UPS_OIDS, decode_ups
from polca.settings import read_secret

__all__ = ["DeviceIdentity", "GenericOid", "SnmpSource", "SnmpSourceConfig", "probe"]

RELEARN_READS: Final = 600
"""Reads between two full reads (every value of the profile): ten minutes at 1 Hz."""
MAX_GET_VARBINDS: Final = 32
"""The most OIDs in one GET (a profile asks for fewer than ten)."""
_BULK_REPETITIONS: Final = 16
"""Rows asked for per GETBULK while walking a column."""
_AUTH_PROTOCOLS: Final = {
    "md5": hlapi.USM_AUTH_HMAC96_MD5,
    "sha": hlapi.USM_AUTH_HMAC96_SHA,
    "sha224": hlapi.USM_AUTH_HMAC128_SHA224,
    "sha256": hlapi.USM_AUTH_HMAC192_SHA256,
    "sha384": hlapi.USM_AUTH_HMAC256_SHA384,
    "sha512": hlapi.USM_AUTH_HMAC384_SHA512,
}
_PRIV_PROTOCOLS: Final = {
    "des": hlapi.USM_PRIV_CBC56_DES,
    "aes": hlapi.USM_PRIV_CFB128_AES,
    "aes192": hlapi.USM_PRIV_CFB192_AES,
    "aes256": hlapi.USM_PRIV_CFB256_AES,
}
_AUTH_REFUSED: Final = (
    errind.UnknownUserName,
    errind.WrongDigest,
    errind.DecryptionError,
    errind.AuthenticationFailure,
    errind.UnsupportedSecurityLevel,
    errind.UnknownSecurityName,
)
_CONFIG_STATUSES: Final = frozenset({"noSuchName", "noAccess", "authorizationError"})
_OID_PATTERN: Final = r"^[0-9]+(\.[0-9]+){1,127}$"


class GenericOid(BaseModel):
    """One OID of the ``generic`` profile: what it measures and its scale."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    oid: str = Field(pattern=_OID_PATTERN)
    """The OID, dotted numbers (a table column's prefix when ``column``)."""
    kind: Kind
    """What it measures: ``power_w``, ``current_a`` or ``voltage_v``."""
    scale: float = Field(1.0, gt=0.0, le=1e6, allow_inf_nan=False)
    """Raw value x scale = the unit (0.1 for tenths)."""
    column: bool = False
    """A table column: its rows (at most 64) are summed, or paired current with voltage."""


class SnmpSourceConfig(BaseModel):
    """One PDU read over SNMP. Secrets are never here: files or systemd credentials."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    protocol: Literal["snmp"]
    """snmp"""
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The source's name, unique within its row."""
    host: str = Field(min_length=1, max_length=253)
    """The PDU's address."""
    port: int = Field(161, ge=1, le=65535)
    """Its SNMP port (UDP)."""
    version: Literal["2c", "3"] = "2c"
    """SNMP v2c (community) or v3 (authPriv)."""
    community_file: Path | None = None
    """v2c: a file holding the community (first line); else the systemd credential."""
    community_credential: str = "snmp_community"
    """v2c: the systemd credential holding the community when community_file is unset."""
    username: str | None = Field(None, min_length=1, max_length=32)
    """v3 (authPriv): the USM user."""
    auth_protocol: Literal["md5", "sha", "sha224", "sha256", "sha384", "sha512"] = "sha"
    """v3: the authentication protocol."""
    auth_key_file: Path | None = None
    """v3: a file holding the authentication key; else the systemd credential."""
    auth_key_credential: str = "snmp_auth_key"
    """v3: the systemd credential holding the authentication key."""
    priv_protocol: Literal["aes", "aes192", "aes256", "des"] = "aes"
    """v3: the privacy (encryption) protocol."""
    priv_key_file: Path | None = None
    """v3: a file holding the privacy key; else the systemd credential."""
    priv_key_credential: str = "snmp_priv_key"
    """v3: the systemd credential holding the privacy key."""
    context_name: str = Field("", max_length=64)
    """v3 context name (empty on most PDUs)."""
    profile: Literal[
        "auto", "apc", "apc_legacy", "raritan", "servertech", "eaton", "vertiv", "ups", "generic"
    ] = "auto"
    """The vendor MIB (``ups``: RFC 1628, any UPS); ``auto``: from sysObjectID at first read."""
    generic: tuple[GenericOid, ...] = Field((), max_length=16)
    """The ``generic`` profile's OIDs, power first in order of preference."""
    power_factor: float = Field(0.95, gt=0.0, le=1.0)
    """For current x voltage, when the device reports no power."""
    nominal_voltage_v: float | None = Field(None, gt=0.0, le=MAX_VOLTAGE_V)
    """The voltage for current-only devices (``apc_legacy``), in V."""
    device_index: int | None = Field(None, ge=0, le=65535)
    """Which device/unit/PDU (daisy chains); None: the profile's first (1; Eaton 0)."""
    inlet_index: int = Field(1, ge=0, le=65535)
    """Which inlet or input cord (Raritan, ServerTech, Eaton)."""
    timeout_s: float = Field(1.0, gt=0.0, le=60.0)
    """Per SNMP request attempt."""
    retries: int = Field(1, ge=0, le=10)
    """Retries of a request that got no answer (each within timeout_s)."""
    ups: bool = False
    """A UPS: also GET its UPS-MIB state (output source, battery, load) as its feed state."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.version == "3") != (self.username is not None):
            msg = "username is required with version 3 and only used by it"
            raise ValueError(msg)
        if (self.profile == "generic") != bool(self.generic):
            msg = "generic lists the OIDs of profile generic, and only of it"
            raise ValueError(msg)
        if self.profile == "apc_legacy" and self.nominal_voltage_v is None:
            msg = "profile apc_legacy reports current only: set nominal_voltage_v"
            raise ValueError(msg)
        return self


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """What a PDU says it is."""

    sys_object_id: str | None
    sys_descr: str | None
    vendor: str | None
    """A built-in profile's name, from the sysObjectID's enterprise number."""


def _python(value: Any) -> object:
    """A pysnmp value as plain Python: int, str, ``MISSING``, or None for anything else."""
    if isinstance(value, rfc1905.NoSuchObject | rfc1905.NoSuchInstance | rfc1905.EndOfMibView):
        return MISSING
    if isinstance(value, univ.Integer):  # Integer32, Gauge32, Counter32/64, TimeTicks
        return int(value)
    if isinstance(value, univ.ObjectIdentifier):
        return str(value)
    if isinstance(value, univ.OctetString) and not isinstance(value, univ.Null):
        text: str = bytes(value).decode("utf-8", errors="replace")
        return text
    return None


class SnmpSource:
    """One PDU's row power over SNMP; a ``MeterSource``."""

    def __init__(
        self,
        config: SnmpSourceConfig,
        *,
        community: str | None = None,
        auth_key: str | None = None,
        priv_key: str | None = None,
    ) -> None:
        """Secrets given here win over ``config``'s files and credentials (the probe)."""
        self._config = config
        self._secrets = (community, auth_key, priv_key)
        self._engine: Any = None
        self._auth: Any = None
        self._target: Any = None
        self._engine_key: tuple[object, ...] | None = None
        self._profile: Profile | None = None
        self._learnt: tuple[Profile, tuple[str, ...]] | None = None  # (one value, fallbacks)
        self._reads_since_full = 0
        self.identity: DeviceIdentity | None = None
        """What the device said it is, once discovered (``auto`` or the probe)."""

    @property
    def name(self) -> str:
        """The configured name."""
        return self._config.name

    @property
    def profile(self) -> Profile | None:
        """The profile in use, bound to the configured indexes, once known."""
        return self._profile

    async def read(self) -> SourceReading:
        """Read the PDU once (see the module docstring for the errors)."""
        profile = await self._bound_profile()
        varbinds: dict[str, object] = {}
        reading = await self._power(profile, varbinds)
        return self._with_ups(reading, varbinds) if self._config.ups else reading

    async def _power(self, profile: Profile, varbinds: dict[str, object]) -> SourceReading:
        """The power, from the learnt value or, every ``RELEARN_READS``, from the top."""
        learnt = self._learnt
        if learnt is not None and self._reads_since_full < RELEARN_READS:
            self._reads_since_full += 1
            try:
                reading = await self._decode(learnt[0], varbinds)
            except (ConfigError, ReadingRejectedError):
                self._learnt = None  # the device changed: ask for everything, now
                varbinds.clear()
            else:
                return replace(reading, fallbacks=learnt[1])
        reading = await self._decode_in_tiers(profile, varbinds)
        self._learnt = (_only(profile, reading.detail), reading.fallbacks)
        self._reads_since_full = 0
        return reading

    async def _decode_in_tiers(
        self, profile: Profile, varbinds: dict[str, object]
    ) -> SourceReading:
        """Ask for the most preferred value first and for the next only when the device
        does not support it: one GET for a PDU that measures its total power."""
        tiers = _tiers(profile)
        for tier in tiers[:-1]:
            await self._fetch(tier, varbinds)
            try:
                return self._decoded(tier, varbinds)
            except ConfigError:
                continue  # none of the values so far exists: the next one
            except ReadingRejectedError as exc:
                if exc.reason != "unsupported":
                    raise  # a value is there but wrong: never skipped over
        await self._fetch(tiers[-1], varbinds)
        return self._decoded(tiers[-1], varbinds)

    async def _decode(self, profile: Profile, varbinds: dict[str, object]) -> SourceReading:
        """One read of ``profile``'s values, decoded."""
        await self._fetch(profile, varbinds)
        return self._decoded(profile, varbinds)

    async def _fetch(self, profile: Profile, varbinds: dict[str, object]) -> None:
        """Add the answers to ``profile``'s requests not answered yet to ``varbinds`` (and,
        for a UPS, its state's: in the read's first GET)."""
        gets, walks = profile.requests()
        if self._config.ups:
            gets = (*UPS_OIDS.values(), *gets)
        varbinds.update(await self._get(tuple(oid for oid in gets if oid not in varbinds)))
        for prefix in walks:
            if not any(oid.startswith(prefix + ".") for oid in varbinds):
                varbinds.update(await self._walk(prefix))

    def _with_ups(self, reading: SourceReading, varbinds: dict[str, object]) -> SourceReading:
        """``reading`` with what the UPS says of its feed (``ReadingRejectedError`` if it
        does not say, or says something outside the MIB)."""
        config = self._config
        values = {name: varbinds.get(oid, MISSING) for name, oid in UPS_OIDS.items()}
        if values["output_source"] is MISSING:
            msg = (
                f"SNMP source {config.name} ({config.host}) is configured ups: true but has "
                f"no UPS-MIB upsOutputSource ({UPS_OIDS['output_source']}): not a UPS, or "
                "its agent does not implement RFC 1628"
            )
            raise ReadingRejectedError(msg, reason="unsupported")
        state = decode_ups(
            {name: None if value is MISSING else value for name, value in values.items()},
            what=f"SNMP source {config.name}",
        )
        return replace(
            reading,
            equipment=state.equipment,
            on_battery=state.on_battery,
            battery_minutes=state.minutes_remaining,
            load_pct=state.percent_load,
            input_voltage_v=state.input_voltage_v,
        )

    def _decoded(self, profile: Profile, varbinds: dict[str, object]) -> SourceReading:
        return decode(
            profile,
            varbinds,
            power_factor=self._config.power_factor,
            nominal_voltage_v=self._config.nominal_voltage_v,
        )

    async def discover(self) -> DeviceIdentity:
        """Read sysObjectID and sysDescr (once; remembered)."""
        if self.identity is None:
            found = await self._get((SYS_OBJECT_ID, SYS_DESCR))
            oid, descr = found.get(SYS_OBJECT_ID), found.get(SYS_DESCR)
            self.identity = DeviceIdentity(
                sys_object_id=oid if isinstance(oid, str) else None,
                sys_descr=descr[:256] if isinstance(descr, str) else None,
                vendor=vendor_of(oid),
            )
        return self.identity

    async def close(self) -> None:
        """Close the engine's socket (idempotent)."""
        key, self._engine_key = self._engine_key, None
        self._engine, self._target = None, None
        if key is not None:
            _release_engine(key)

    async def _bound_profile(self) -> Profile:
        if self._profile is None:
            config = self._config
            if config.profile == "auto":
                profile = profile_for((await self.discover()).sys_object_id)
            elif config.profile == "generic":
                profile = generic_profile(
                    (g.kind, Value(g.kind, g.oid, g.scale, g.column)) for g in config.generic
                )
            else:
                profile = PROFILES[config.profile]
            self._profile = profile.bind(device=config.device_index, inlet=config.inlet_index)
        return self._profile

    async def _session(self) -> tuple[Any, Any, Any]:
        """The engine, credentials and target, made at first use."""
        config = self._config
        if self._engine is None:
            community, auth_key, priv_key = self._secrets
            key: tuple[object, ...]
            if config.version == "2c":
                community = community or _secret(
                    config.community_file, config.community_credential, "community"
                )
                # v2c is what most PDUs speak; v3 is offered and preferred.
                self._auth = hlapi.CommunityData(community, mpModel=1)  # noqa: S508
                key = ("2c",)
            else:
                auth_key = auth_key or _secret(
                    config.auth_key_file, config.auth_key_credential, "auth"
                )
                priv_key = priv_key or _secret(
                    config.priv_key_file, config.priv_key_credential, "priv"
                )
                self._auth = hlapi.UsmUserData(
                    config.username,
                    auth_key,
                    priv_key,
                    authProtocol=_AUTH_PROTOCOLS[config.auth_protocol],
                    privProtocol=_PRIV_PROTOCOLS[config.priv_protocol],
                )
                key = (
                    "3",
                    config.username,
                    config.auth_protocol,
                    auth_key,
                    config.priv_protocol,
                    priv_key,
                )
            key = (id(asyncio.get_running_loop()), *key)
            self._engine = _acquire_engine(key)
            self._engine_key = key
        if self._target is None:
            try:
                self._target = await hlapi.UdpTransportTarget.create(
                    (config.host, config.port), timeout=config.timeout_s, retries=config.retries
                )
            except Exception as exc:  # pysnmp wraps resolver errors in its own class
                msg = f"SNMP source {config.name}: cannot resolve {config.host}: {exc}"
                raise TransportError(msg) from exc
        return self._engine, self._auth, self._target

    async def _request(self, command: Any, *args: Any) -> list[tuple[str, object]]:
        """One SNMP request; its var-binds as (OID, Python value), or our errors."""
        engine, auth, target = await self._session()
        config = self._config
        bound_s = config.timeout_s * (config.retries + 1) + 1.0
        context = hlapi.ContextData(contextName=config.context_name)
        try:
            async with asyncio.timeout(bound_s):
                indication, status, index, varbinds = await command(
                    engine, auth, target, context, *args, lookupMib=False
                )
        except TimeoutError as exc:
            msg = f"SNMP source {config.name}: no answer from {config.host} in {bound_s:g} s"
            raise TransportError(msg) from exc
        except pysnmp_error.PySnmpError as exc:  # raised, not returned, by some v3 failures
            indication = exc.get("errorIndication") if hasattr(exc, "get") else None
            msg = f"SNMP source {config.name} ({config.host}): {indication or exc}"
            if isinstance(indication, errind.EncryptionError):
                msg += " (SNMPv3 privacy needs the cryptography package)"
                raise ConfigError(msg) from exc
            raise TransportError(msg) from exc
        if indication:
            msg = f"SNMP source {config.name} ({config.host}): {indication}"
            if isinstance(indication, _AUTH_REFUSED):
                raise TransportAuthError(msg)
            raise TransportError(msg)
        if status:
            name = status.prettyPrint() if hasattr(status, "prettyPrint") else str(status)
            msg = f"SNMP source {config.name} ({config.host}): {name} at var-bind {int(index)}"
            raise (ConfigError if name in _CONFIG_STATUSES else TransportError)(msg)
        return [(str(oid), _python(value)) for oid, value in varbinds]

    async def _get(self, oids: tuple[str, ...]) -> dict[str, object]:
        found: dict[str, object] = {}
        for start in range(0, len(oids), MAX_GET_VARBINDS):
            chunk = oids[start : start + MAX_GET_VARBINDS]
            objects = [hlapi.ObjectType(hlapi.ObjectIdentity(oid)) for oid in chunk]
            found.update(await self._request(hlapi.get_cmd, *objects))
        return found

    async def _walk(self, prefix: str) -> dict[str, object]:
        """A column's rows, at most ``MAX_ROWS`` + 1 (so the decoder sees the overflow)."""
        rows: dict[str, object] = {}
        last = prefix
        while len(rows) <= MAX_ROWS:
            answer = await self._request(
                hlapi.bulk_cmd,
                0,
                _BULK_REPETITIONS,
                hlapi.ObjectType(hlapi.ObjectIdentity(last)),
            )
            if not answer:
                return rows
            for oid, value in answer:
                if not oid.startswith(prefix + ".") or value is MISSING:
                    return rows
                if _oid_key(oid) <= _oid_key(last):
                    msg = f"SNMP source {self.name}: agent walked backwards at {oid}"
                    raise TransportError(msg)
                rows[oid] = value
                last = oid
        return rows


@dataclass(slots=True)
class _SharedEngine:
    engine: Any
    users: int


_ENGINES: dict[tuple[object, ...], _SharedEngine] = {}
"""Engines by (event loop, credentials); bounded by the sources configured."""


def _acquire_engine(key: tuple[object, ...]) -> Any:
    """The engine for ``key``, made at its first user."""
    shared = _ENGINES.get(key)
    if shared is None:
        shared = _ENGINES[key] = _SharedEngine(_new_engine(), 0)
    shared.users += 1
    return shared.engine


def _release_engine(key: tuple[object, ...]) -> None:
    """One user less; the last closes the engine's socket."""
    shared = _ENGINES.get(key)
    if shared is None:
        return
    shared.users -= 1
    if shared.users <= 0:
        del _ENGINES[key]
        shared.engine.close_dispatcher()


def _only(profile: Profile, detail: str) -> Profile:
    """``profile`` reduced to the value a reading's ``detail`` names (the one to ask for
    from now on); the whole profile when the detail names none of its values."""
    for value in profile.power:
        if detail == value.label or detail.startswith(f"{value.label} ("):
            return replace(profile, power=(value,), current=None, voltage=None)
    if profile.current is not None and detail.startswith(profile.current.label + " x "):
        return replace(profile, power=())
    return profile


def _tiers(profile: Profile) -> list[Profile]:
    """``profile`` cut after each power value, most preferred first, then whole."""
    tiers = [
        replace(profile, power=profile.power[: i + 1], current=None, voltage=None)
        for i in range(len(profile.power))
    ]
    return [*tiers, profile]


def _new_engine() -> Any:
    """An SNMP engine whose MIB compiler never fetches MIBs from the network.

    pysnmp adds a MIB compiler (pysmi, when installed) at the first request, reading MIBs
    from the Internet and calling names pysmi 2 deprecates. Adding it here, once, with
    local sources only and those warnings silenced (synchronously: no other task runs
    meanwhile), makes pysnmp's own call a no-op. Every OID polca sends is numeric.
    """
    engine = hlapi.SnmpEngine()
    controller = CommandGeneratorVarBinds.get_mib_view_controller(engine.cache)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".* is deprecated\. Please use ", DeprecationWarning)
        compiler.add_mib_compiler(
            controller.mibBuilder,
            sources=["file:///usr/share/snmp/mibs"],
            ifAvailable=True,
            ifNotAdded=True,
        )
    return engine


def _oid_key(oid: str) -> tuple[int, ...]:
    return tuple(int(arc) for arc in oid.split("."))


def _secret(path: Path | None, credential: str, what: str) -> str:
    try:
        secret = read_secret(path, credential)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not secret:
        where = f"{path} or " if path else ""
        msg = f"SNMP {what} secret missing: set it in {where}the systemd credential {credential}"
        raise ConfigError(msg)
    return secret


async def probe(
    url: str,
    *,
    community: str | None,
    username: str | None,
    password: str | None,
    profile: str | None,
) -> dict[str, object]:
    """Read ``snmp://host[:port][/context]`` once and say what it is (``polca meter probe``).

    v2c with ``community``, or v3 authPriv as ``username`` with ``password`` as both the
    SHA auth key and the AES privacy key (and the URL's path as the v3 context name).
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or 161
    except ValueError as exc:
        msg = f"not an SNMP URL (snmp://host[:port]): {url!r}"
        raise ConfigError(msg) from exc
    if parts.scheme != "snmp" or not parts.hostname:
        msg = f"not an SNMP URL (snmp://host[:port]): {url!r}"
        raise ConfigError(msg)
    try:
        config = SnmpSourceConfig(
            protocol="snmp",
            name="probe",
            host=parts.hostname,
            port=port,
            version="3" if username else "2c",
            username=username,
            context_name=parts.path.strip("/"),
            profile=profile or "auto",  # pydantic checks the name
        )
    except (ValidationError, ValueError) as exc:
        msg = f"cannot probe {url}: {exc}"
        raise ConfigError(msg) from exc
    source = SnmpSource(config, community=community, auth_key=password, priv_key=password)
    try:
        identity = await source.discover()
        reading = await source.read()
    finally:
        await source.close()
    return {
        "power_w": reading.power_w,
        "source": reading.detail,
        "vendor": identity.vendor,
        "profile": source.profile.name if source.profile else None,
        "sys_object_id": identity.sys_object_id,
        "sys_descr": identity.sys_descr,
        "fallbacks": list(reading.fallbacks),
    }
