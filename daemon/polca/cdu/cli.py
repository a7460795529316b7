"""``polca cdu``: run a CDU telemetry source as a process.

- ``polca cdu simulate``: a simulated CDU (``SimulatedCdu``) publishing its telemetry; its
  heat input is constant (``--heat-kw``) or follows the agents' telemetry of the racks it
  serves (``--rack ROW/RACK``); ``--fault KIND@START[:END]`` scripts incidents.
- ``polca cdu modbus --config FILE``: poll a real CDU over Modbus TCP with a register map
  and publish its telemetry; ``--once`` prints one reading and exits (commissioning).
- ``polca cdu redfish --config FILE``: the same for a CDU with a Redfish service
  (``CoolingUnit``); same options, same exit codes.

``polca.cli`` wires these in with ``add_parsers(sub)`` and ``main(args)``. Exit codes as
the rest of polca (``polca.exits``): 0, 1 on a failure, 78 for a configuration problem.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polca import logs
from polca.exits import EX_CONFIG, EX_FAILURE, run_process
from polca.plant.faults import FAULT_KINDS, FaultEvent, parse_fault

if TYPE_CHECKING:
    from polca.cdu.config import CduSettings
    from polca.cdu.publisher import CduPoller
    from polca.plant.cdu import SimulatedCdu

__all__ = ["add_parsers", "main"]


def add_parsers(subparsers: Any) -> None:
    """Add ``cdu simulate``, ``cdu modbus`` and ``cdu redfish`` to the sub-command parsers."""
    cdu = subparsers.add_parser(
        "cdu", help="CDU telemetry sources: simulated plant, Modbus, Redfish"
    )
    csub = cdu.add_subparsers(dest="cdu_command", required=True)

    sim = csub.add_parser("simulate", help="publish the telemetry of a simulated CDU")
    _common(sim)
    sim.add_argument("--name", default="cdu1", help="CDU name (topic segment)")
    sim.add_argument("--loop", default="loop1", help="cooling loop it serves")
    sim.add_argument(
        "--rack",
        action="append",
        default=[],
        metavar="ROW/RACK",
        help="a rack the loop serves: heat input from its agents' telemetry (repeatable)",
    )
    sim.add_argument(
        "--heat-kw", type=float, default=60.0, help="constant heat input without --rack"
    )
    sim.add_argument("--capacity-kw", type=float, default=100.0)
    sim.add_argument("--design-flow-lpm", type=float, default=150.0)
    sim.add_argument("--setpoint-c", type=float, default=30.0)
    sim.add_argument("--capture-fraction", type=float, default=0.8)
    sim.add_argument("--pumps", type=int, default=2)
    sim.add_argument("--redundancy", type=int, default=1)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--fault",
        type=parse_fault,
        action="append",
        default=[],
        metavar="KIND@START[:END]",
        help=f"script a fault, seconds from start (repeatable): {', '.join(FAULT_KINDS)}",
    )

    mb = csub.add_parser("modbus", help="poll a CDU over Modbus TCP and publish its telemetry")
    _common(mb)
    mb.add_argument(
        "--once", action="store_true", help="print one reading as JSON and exit (no MQTT)"
    )

    rf = csub.add_parser("redfish", help="poll a CDU over Redfish and publish its telemetry")
    _common(rf)
    rf.add_argument(
        "--once", action="store_true", help="print one reading as JSON and exit (no MQTT)"
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="YAML settings file")
    p.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    p.add_argument("--site", default=None, help="site name (default: settings, 'site')")
    p.add_argument("--interval", type=float, default=None, help="publish period in seconds")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    logs.add_options(p)


def main(args: argparse.Namespace) -> int:
    """Run ``polca cdu ...``; returns the exit code."""
    return run_process("cdu", lambda: _checked(args), lambda s: _body(args, s), stream=sys.stderr)


def _checked(args: argparse.Namespace) -> CduSettings:
    """The settings, with the section the command needs."""
    from polca.errors import ConfigError  # noqa: PLC0415

    settings = _settings(args)
    if args.cdu_command == "modbus" and settings.modbus is None:
        msg = "polca cdu modbus needs a 'modbus:' section (the CDU and its map) in --config"
        raise ConfigError(msg)
    if args.cdu_command == "redfish" and settings.redfish is None:
        msg = "polca cdu redfish needs a 'redfish:' section (the CDU and its endpoint) in --config"
        raise ConfigError(msg)
    return settings


async def _body(args: argparse.Namespace, settings: CduSettings) -> int | None:
    # The poller logs outages once; pymodbus would log every failed connect.
    logging.getLogger("pymodbus").setLevel(logging.CRITICAL)
    if args.cdu_command == "simulate":
        await _simulate(args, settings)
        return None
    if args.once:
        return await _poll_once(settings, args.cdu_command)
    await _poll(args, settings)
    return None


def _settings(args: argparse.Namespace) -> CduSettings:
    from polca.cdu.config import CduSettings  # noqa: PLC0415
    from polca.settings import load_source_settings  # noqa: PLC0415

    return load_source_settings(CduSettings, args)


async def _simulate(args: argparse.Namespace, settings: CduSettings) -> None:
    from polca.cdu.publisher import (  # noqa: PLC0415
        RackPowerTracker,
        run_plant,
        track_rack_power,
    )
    from polca.plant.cdu import SimulatedCdu  # noqa: PLC0415
    from polca.plant.ratings import CduRatings  # noqa: PLC0415
    from polca.service import serve_source  # noqa: PLC0415
    from polca.telemetry.bus import MqttBus  # noqa: PLC0415
    from polca.telemetry.topics import Topics  # noqa: PLC0415

    ratings = CduRatings(
        heat_capacity_kw=args.capacity_kw,
        design_flow_lpm=args.design_flow_lpm,
        supply_setpoint_c=args.setpoint_c,
        supply_min_c=args.setpoint_c - 10.0,
        supply_max_c=args.setpoint_c + 5.0,
        capture_fraction=args.capture_fraction,
        pump_count=args.pumps,
        pump_redundancy=args.redundancy,
    )
    plant = SimulatedCdu(
        args.name, loop=args.loop, ratings=ratings, seed=args.seed, heat_kw=args.heat_kw
    )
    topics = Topics(settings.topic_root)
    rows = sorted({rack.split("/", 1)[0] for rack in args.rack})
    bus = MqttBus(
        settings.mqtt,
        client_id=settings.mqtt.client_id or f"polca-cdu-{args.name}",
        subscriptions=[(topics.all_nodes(settings.site, row, "telemetry"), 0) for row in rows],
    )
    tracker = RackPowerTracker(topics=topics, racks=args.rack) if args.rack else None
    loops: list[tuple[str, Coroutine[Any, Any, object]]] = [
        (
            "cdu-plant",
            run_plant(
                bus,
                plant,
                site=settings.site,
                interval_s=settings.interval_s,
                rack_power_w=tracker.power_w if tracker is not None else None,
                topics=topics,
            ),
        )
    ]
    if tracker is not None:
        loops.append(("rack-power", track_rack_power(bus, tracker)))
    if args.fault:
        loops.append(("cdu-faults", _fault_script(plant, args.fault)))
    await serve_source(bus, loops, duration_s=args.duration)


async def _fault_script(plant: SimulatedCdu, events: list[FaultEvent]) -> None:
    """Inject and clear the scripted faults at their times, then idle."""
    import structlog  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    start = loop.time()
    actions = sorted(
        [(e.start_s, True, e.kind) for e in events]
        + [(e.end_s, False, e.kind) for e in events if e.end_s is not None]
    )
    log = structlog.get_logger()
    for at_s, inject, kind in actions:
        await asyncio.sleep(max(0.0, start + at_s - loop.time()))
        if inject:
            plant.inject(kind)
        else:
            plant.clear(kind)
        log.warning(
            "cdu_fault_injected" if inject else "cdu_fault_cleared", cdu=plant.name, fault=kind
        )
    await asyncio.Event().wait()  # eternal, like the other loops


def _poller(settings: CduSettings, protocol: str) -> CduPoller:
    """The poller of ``polca cdu modbus`` or ``polca cdu redfish`` (checked in main())."""
    if protocol == "redfish":
        from polca.cdu.redfish import RedfishCduPoller  # noqa: PLC0415

        assert settings.redfish is not None  # noqa: S101 - checked in main()
        return RedfishCduPoller(settings.redfish)
    from polca.cdu.modbus import ModbusCduPoller  # noqa: PLC0415 - imports pymodbus

    assert settings.modbus is not None  # noqa: S101 - checked in main()
    return ModbusCduPoller(settings.modbus)


async def _poll(args: argparse.Namespace, settings: CduSettings) -> None:
    from polca.cdu.publisher import run_poller  # noqa: PLC0415
    from polca.service import serve_source  # noqa: PLC0415
    from polca.telemetry.bus import MqttBus  # noqa: PLC0415
    from polca.telemetry.topics import Topics  # noqa: PLC0415

    poller = _poller(settings, args.cdu_command)
    cdu = poller.config.cdu
    bus = MqttBus(settings.mqtt, client_id=settings.mqtt.client_id or f"polca-cdu-{cdu}")
    loop = run_poller(
        bus,
        poller,
        site=settings.site,
        interval_s=settings.interval_s,
        topics=Topics(settings.topic_root),
    )
    await serve_source(bus, [(f"cdu-{args.cdu_command}", loop)], duration_s=args.duration)


async def _poll_once(settings: CduSettings, protocol: str = "modbus") -> int:
    from polca.cdu.publisher import close_poller  # noqa: PLC0415
    from polca.errors import FatalError, PolcaError  # noqa: PLC0415

    poller = _poller(settings, protocol)
    try:
        telemetry = await poller.poll()
    except PolcaError as exc:
        sys.stderr.write(f"{exc}\n")
        return EX_CONFIG if isinstance(exc, FatalError) else EX_FAILURE
    finally:
        await close_poller(poller)
    sys.stdout.write(telemetry.model_dump_json(indent=2) + "\n")
    return 0
