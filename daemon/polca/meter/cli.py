"""``polca meter``: the row power service, and the probe an operator runs first.

- ``polca meter run --config FILE``: poll every row's sources (SNMP, Redfish, Modbus TCP)
  every ``interval_s`` and publish each row's ``meter`` reading; ``--once`` prints one
  round as JSON and exits (commissioning, no MQTT).
- ``polca meter probe URL``: read one device and print one JSON object (``power_w``,
  ``source``, ...): ``snmp://host[:port]`` (vendor from ``sysObjectID``, ``--profile``
  overrides; ``--community`` or ``--username``/``--password-file`` for SNMPv3),
  ``https://host[:port]`` (Redfish, from the service root; ``http://`` for labs) or
  ``modbus://host[:port]`` (``--register`` and its encoding).

``polca.cli`` wires these in with ``add_parsers(sub)`` and ``main(args)``. Exit codes
(``polca.exits``): 0; a probe that fails prints one line on stderr and exits 69 (the
device unreachable), 77 (credentials refused), 65 (an answer with no usable power),
78 (a configuration or usage problem) or 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polca import logs
from polca.exits import one_shot_code, run_process

if TYPE_CHECKING:
    from polca.meter.config import MeterSettings, SourceConfig
    from polca.meter.service import MeterRow
    from polca.meter.source import MeterSource

__all__ = ["add_parsers", "build_source", "main"]


def add_parsers(subparsers: Any) -> None:
    """Add ``meter run`` and ``meter probe`` to the ``polca`` sub-command parsers."""
    meter = subparsers.add_parser("meter", help="row power from PDUs and meters")
    msub = meter.add_subparsers(dest="meter_command", required=True)

    run = msub.add_parser("run", help="poll every row's sources and publish its meter reading")
    run.add_argument("--config", type=Path, default=None, help="YAML settings file")
    run.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    run.add_argument("--site", default=None, help="site name (default: settings, 'site')")
    run.add_argument("--interval", type=float, default=None, help="poll period in seconds")
    run.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    run.add_argument(
        "--once", action="store_true", help="print one round as JSON and exit (no MQTT)"
    )
    logs.add_options(run)

    probe = msub.add_parser("probe", help="read one PDU or meter and print its power as JSON")
    probe.add_argument(
        "url", help="snmp://host[:port], https://host[:port] or modbus://host[:port]"
    )
    probe.add_argument("--community", default=None, help="SNMP v2c community")
    probe.add_argument("--username", default=None, help="SNMPv3 user or Redfish user")
    probe.add_argument(
        "--password-file", type=Path, default=None, help="SNMPv3 key or Redfish password file"
    )
    probe.add_argument(
        "--profile", default=None, help="SNMP vendor profile (default: from sysObjectID)"
    )
    probe.add_argument("--ca-file", type=Path, default=None, help="CA bundle (https)")
    probe.add_argument(
        "--insecure", action="store_true", help="do not verify the TLS certificate (labs)"
    )
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds per request")
    probe.add_argument("--register", type=int, default=None, help="Modbus power register")
    probe.add_argument(
        "--type",
        dest="register_type",
        choices=["uint16", "int16", "uint32", "int32", "float32"],
        default="uint32",
        help="Modbus register encoding",
    )
    probe.add_argument("--unit", choices=["w", "kw"], default="w", help="Modbus register unit")
    probe.add_argument("--scale", type=float, default=1.0, help="Modbus register scale")
    probe.add_argument("--table", choices=["holding", "input"], default="holding")
    probe.add_argument("--device-id", type=int, default=1, help="Modbus unit id")


def main(args: argparse.Namespace) -> int:
    """Run ``polca meter ...``; returns the exit code."""
    # Sources log outages once; pymodbus would log every failed connect.
    logging.getLogger("pymodbus").setLevel(logging.CRITICAL)
    if args.meter_command == "probe":
        return _probe_main(args)
    return run_process(
        "meter",
        lambda: _settings(args),
        lambda settings: _once(settings) if args.once else _run(args, settings),
        stream=sys.stderr,
    )


def _settings(args: argparse.Namespace) -> MeterSettings:
    from polca.errors import ConfigError  # noqa: PLC0415
    from polca.meter.config import MeterSettings  # noqa: PLC0415
    from polca.settings import load_source_settings  # noqa: PLC0415

    settings = load_source_settings(MeterSettings, args)
    if not settings.rows:
        msg = "polca meter run needs a 'rows:' section (each row and its sources) in --config"
        raise ConfigError(msg)
    return settings


def build_source(config: SourceConfig) -> MeterSource:
    """The reader of one configured source (no I/O until its first read)."""
    if config.protocol == "snmp":
        from polca.meter.snmp import SnmpSource  # noqa: PLC0415 - imports pysnmp

        return SnmpSource(config)
    if config.protocol == "redfish":
        from polca.meter.redfish import RedfishMeterSource  # noqa: PLC0415

        return RedfishMeterSource(config)
    from polca.meter.modbus import ModbusMeterSource  # noqa: PLC0415 - imports pymodbus

    return ModbusMeterSource(config)


def _rows(settings: MeterSettings) -> list[MeterRow]:
    from polca.meter.service import MeterRow  # noqa: PLC0415
    from polca.telemetry.topics import Topics  # noqa: PLC0415

    topics = Topics(settings.topic_root)
    return [
        MeterRow(
            row=row.row,
            topic=row.topic or topics.meter(settings.site, row.row),
            sources=tuple(build_source(source) for source in row.sources),
        )
        for row in settings.rows
    ]


async def _run(args: argparse.Namespace, settings: MeterSettings) -> None:
    from polca.meter.service import run_meter  # noqa: PLC0415
    from polca.service import serve_source  # noqa: PLC0415
    from polca.telemetry.bus import MqttBus  # noqa: PLC0415

    bus = MqttBus(settings.mqtt, client_id=settings.client_id)
    loop = run_meter(
        bus,
        _rows(settings),
        interval_s=settings.interval_s,
        read_timeout_s=settings.read_bound_s,
        stats_every_s=settings.stats_every_s,
    )
    await serve_source(bus, [("meter", loop)], duration_s=args.duration)


class _Collect:
    """A publisher that keeps what it is given (``--once``)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def publish_nowait(self, msg: Any) -> None:
        self.messages.append(msg)


async def _once(settings: MeterSettings) -> int:
    from polca.meter.row import SourceLog  # noqa: PLC0415
    from polca.meter.service import meter_once  # noqa: PLC0415

    rows = _rows(settings)
    book = SourceLog()
    try:
        # One round, and the first: each source also finds its device (vendor, resources).
        published = await meter_once(
            _Collect(), rows, sources_log=book, read_timeout_s=max(settings.read_bound_s, 5.0)
        )
    finally:
        for row in rows:
            for source in row.sources:
                await source.close()
    out = {
        row.row: {"topic": row.topic, **meter.model_dump(mode="json", exclude={"kind"})}
        for row, meter in published
    }
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 1 if any(meter.partial for _, meter in published) else 0


def _probe_main(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(_probe(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, never a traceback
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sys.stderr.write(f"polca meter probe: {text}\n")
        return one_shot_code(exc)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


async def _probe(args: argparse.Namespace) -> dict[str, object]:
    from polca.errors import ConfigError  # noqa: PLC0415
    from polca.settings import read_secret  # noqa: PLC0415

    url: str = args.url
    password = read_secret(args.password_file, "meter_password") if args.password_file else None
    if args.password_file is not None and password is None:
        msg = f"cannot read the password file {args.password_file}"
        raise ConfigError(msg)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "snmp":
        from polca.meter.snmp import probe as snmp_probe  # noqa: PLC0415

        return await snmp_probe(
            url,
            community=args.community,
            username=args.username,
            password=password,
            profile=args.profile,
        )
    if scheme in ("http", "https"):
        from polca.meter.redfish import probe as redfish_probe  # noqa: PLC0415

        return await redfish_probe(
            url,
            username=args.username,
            password=password,
            ca_file=args.ca_file,
            verify_tls=not args.insecure,
            timeout_s=args.timeout,
        )
    if scheme == "modbus":
        return await _modbus_probe(url, args)
    msg = f"unsupported URL {url!r}: use snmp://, https:// (http:// in labs) or modbus://"
    raise ConfigError(msg)


async def _modbus_probe(url: str, args: argparse.Namespace) -> dict[str, object]:
    from urllib.parse import urlsplit  # noqa: PLC0415

    from pydantic import ValidationError  # noqa: PLC0415

    from polca.errors import ConfigError  # noqa: PLC0415
    from polca.meter.modbus import ModbusMeterConfig, ModbusMeterSource  # noqa: PLC0415

    if args.register is None:
        msg = "a modbus:// probe needs --register (the power register's address)"
        raise ConfigError(msg)
    try:
        parts = urlsplit(url)
        config = ModbusMeterConfig(
            protocol="modbus",
            name="probe",
            host=parts.hostname or "",
            port=parts.port or 502,
            device_id=args.device_id,
            timeout_s=args.timeout,
            points=(
                {
                    "field": "power.0",
                    "address": args.register,
                    "type": args.register_type,
                    "table": args.table,
                    "unit": args.unit,
                    "scale": args.scale,
                },
            ),
        )
    except (ValueError, ValidationError) as exc:
        msg = f"bad modbus probe: {exc}".splitlines()[0]
        raise ConfigError(msg) from exc
    source = ModbusMeterSource(config)
    try:
        reading = await source.read()
    finally:
        await source.close()
    return {
        "power_w": reading.power_w,
        "source": f"modbus {args.table} register {args.register} ({args.register_type}, "
        f"{args.unit}, scale {args.scale:g})",
        "device_id": args.device_id,
    }
