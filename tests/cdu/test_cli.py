"""``polca cdu simulate`` and ``polca cdu modbus``: arguments, exit codes, real runs."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from pathlib import Path

import pytest
import yaml
from structlog.testing import capture_logs

from polca.cdu import cli
from polca.cdu.config import CduSettings
from polca.exits import EX_CONFIG
from polca.plant.faults import FaultEvent, parse_fault
from polca.settings import MqttSettings, load_settings_as
from polca.telemetry.bus import MqttBus
from polca.telemetry.schema import CduTelemetry, decode
from polca.telemetry.topics import Topics
from tests.modbus.conftest import ModbusTestServer
from tests.mqtt_broker import MosquittoProcess, free_port

# How a test runs the commands before polca.cli wires them in: the same two calls.
ENTRY = (
    "import argparse, sys\n"
    "from polca.cdu import cli\n"
    "parser = argparse.ArgumentParser(prog='polca')\n"
    "cli.add_parsers(parser.add_subparsers(dest='command', required=True))\n"
    "sys.exit(cli.main(parser.parse_args(sys.argv[1:])))\n"
)


def parse(*argv: str) -> argparse.Namespace:
    """Parse ``polca ARGV`` with the cdu sub-commands added."""
    parser = argparse.ArgumentParser(prog="polca")
    cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_parse_fault() -> None:
    """KIND@START[:END] parses; anything else is a usage error naming the kinds."""
    assert parse_fault("pump_failure@60:180") == FaultEvent("pump_failure", 60.0, 180.0)
    assert parse_fault("leak@5") == FaultEvent("leak", 5.0, None)
    for bad in ("meteor@1", "leak", "leak@5:2", "leak@x"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad fault"):
            parse_fault(bad)


def test_sub_commands_parse() -> None:
    """cdu simulate and cdu modbus take their options."""
    args = parse(
        "cdu", "simulate", "--rack", "row1/rack1", "--rack", "row1/rack2",
        "--fault", "fouling@10", "--heat-kw", "40", "--broker", "127.0.0.1:1884",
    )  # fmt: skip
    assert args.command == "cdu"
    assert args.cdu_command == "simulate"
    assert args.rack == ["row1/rack1", "row1/rack2"]
    assert args.fault == [FaultEvent("fouling", 10.0)]
    assert parse("cdu", "modbus", "--config", "x.yaml", "--once").once


def test_modbus_without_a_map_is_a_config_error(tmp_path: Path) -> None:
    """polca cdu modbus with no modbus section exits 78 (EX_CONFIG)."""
    config = tmp_path / "cdu.yaml"
    config.write_text("site: s1\n", encoding="utf-8")
    assert cli.main(parse("cdu", "modbus", "--config", str(config))) == EX_CONFIG
    config.write_text(
        "modbus: {cdu: c, loop: l, host: h, points: [{field: nope, address: 0}]}\n",
        encoding="utf-8",
    )
    assert cli.main(parse("cdu", "modbus", "--config", str(config))) == EX_CONFIG


def write_config(path: Path, broker_port: int, server: ModbusTestServer | None = None) -> Path:
    """A polca cdu settings file for the test broker (and Modbus server)."""
    raw: dict[str, object] = {
        "mqtt": {"host": "127.0.0.1", "port": broker_port, "reconnect_min_s": 0.05},
        "site": "s1",
        "interval_s": 0.1,
        "logging": {"level": "info", "format": "json"},
    }
    if server is not None:
        raw["modbus"] = {
            "cdu": "cdu3",
            "loop": "loop3",
            "host": server.host,
            "port": server.port,
            "timeout_s": 1.0,
            "points": [
                {"field": "secondary.supply_temp_c", "address": 0, "scale": 0.1},
                {"field": "pumps.0.state", "address": 1, "enum": {1: "running"}},
            ],
        }
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


async def run_polca(*argv: str, timeout_s: float = 30.0) -> tuple[int, str]:
    """Run ``polca ARGV`` (cdu commands) in a subprocess; exit code and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        ENTRY,
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout_s):
            _, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, err.decode()


async def listen(port: int, topic: str) -> tuple[MqttBus, asyncio.Task[None]]:
    """A subscribed bus, connected."""
    bus = MqttBus(
        MqttSettings(host="127.0.0.1", port=port), client_id="cli-test", subscriptions=[(topic, 0)]
    )
    task = asyncio.create_task(bus.run())
    async with asyncio.timeout(10):
        await bus.connected.wait()
    await asyncio.sleep(0.1)
    return bus, task


async def settle(bus: MqttBus, quiet_s: float = 0.5, limit_s: float = 10.0) -> list[CduTelemetry]:
    """Every CDU message, once none has arrived for ``quiet_s`` (the last ones in flight
    when the command ended, however loaded the machine), within ``limit_s``."""
    out = drain(bus)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    quiet_until = loop.time() + quiet_s
    while loop.time() < min(quiet_until, deadline):
        await asyncio.sleep(0.05)
        if more := drain(bus):
            out += more
            quiet_until = loop.time() + quiet_s
    return out


def drain(bus: MqttBus) -> list[CduTelemetry]:
    """Every CDU message received so far."""
    out = []
    while not bus.inbox.empty():
        message = decode(bus.inbox.get_nowait().payload, CduTelemetry)
        assert isinstance(message, CduTelemetry)
        out.append(message)
    return out


async def test_simulate_publishes_and_scripts_a_telemetry_loss(
    mosquitto: MosquittoProcess, tmp_path: Path
) -> None:
    """polca cdu simulate publishes telemetry and goes silent during a scripted loss."""
    config = write_config(tmp_path / "cdu.yaml", mosquitto.port)
    bus, task = await listen(mosquitto.port, Topics().cdu("s1", "cdu8"))
    try:
        code, err = await run_polca(
            "cdu", "simulate", "--config", str(config), "--name", "cdu8",
            "--duration", "3.5", "--fault", "telemetry_loss@1.5:2.5",
        )  # fmt: skip
        messages = await settle(bus)
    finally:
        await bus.close(timeout_s=1.0)
        await task
    assert code == 0, err
    assert "cdu_fault_injected" in err
    assert "cdu_fault_cleared" in err
    assert len(messages) >= 10
    gaps_s = [(b.ts_ns - a.ts_ns) / 1e9 for a, b in itertools.pairwise(messages)]
    assert max(gaps_s) > 0.7  # the scripted second without telemetry
    assert all(m.cdu == "cdu8" for m in messages)


async def test_modbus_command_publishes_polls(
    mosquitto: MosquittoProcess, modbus_server: ModbusTestServer, tmp_path: Path
) -> None:
    """polca cdu modbus polls the server and publishes its readings."""
    await modbus_server.set("holding", 0, [301, 1])
    config = write_config(tmp_path / "cdu.yaml", mosquitto.port, modbus_server)
    bus, task = await listen(mosquitto.port, Topics().cdu("s1", "cdu3"))
    try:
        code, err = await run_polca("cdu", "modbus", "--config", str(config), "--duration", "2")
        messages = await settle(bus)
    finally:
        await bus.close(timeout_s=1.0)
        await task
    assert code == 0, err
    assert "cdu_poller_started" in err
    assert len(messages) >= 5
    assert messages[-1].secondary.supply_temp_c == pytest.approx(30.1)
    assert messages[-1].pumps[0].state == "running"


async def test_once_prints_one_reading(
    modbus_server: ModbusTestServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--once prints one reading as JSON; an unreachable CDU exits 1."""
    await modbus_server.set("holding", 0, [295, 1])
    path = write_config(tmp_path / "cdu.yaml", free_port(), modbus_server)
    settings = load_settings_as(CduSettings, path)
    with capture_logs():  # keep structlog's default stdout printer out of the JSON
        assert await cli._poll_once(settings) == 0
    printed = decode(capsys.readouterr().out.encode(), CduTelemetry)
    assert isinstance(printed, CduTelemetry)
    assert printed.secondary.supply_temp_c == pytest.approx(29.5)
    await modbus_server.stop()
    with capture_logs():
        assert await cli._poll_once(settings) == 1
    assert "cannot connect" in capsys.readouterr().err
