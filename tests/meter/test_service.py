"""``polca meter``: rows summed from real SNMP agents, partial readings, a real broker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import aiomqtt
import pytest
import yaml

from polca.errors import ReadingRejectedError
from polca.meter.row import SourceFailure, SourceLog
from polca.meter.service import MeterRow, meter_once, read_source
from polca.meter.snmp import SnmpSource, SnmpSourceConfig
from polca.meter.source import SourceReading
from polca.telemetry.checks import DropLog
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Meter, decode
from tests.mqtt_broker import MosquittoProcess
from tests.snmpsim import SnmpSimProcess

TOPIC = "polca/v1/dc1/row1/meter"


class Collect:
    """A publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.messages: list[OutMessage] = []

    def publish_nowait(self, msg: OutMessage) -> None:
        self.messages.append(msg)


def _snmp(agent: SnmpSimProcess, name: str) -> dict[str, Any]:
    return {
        "protocol": "snmp",
        "name": name,
        "host": agent.host,
        "port": agent.port,
        "timeout_s": 0.3,
        "retries": 0,
    }


class Broken:
    """A source whose reader has a bug."""

    name = "broken"

    async def read(self) -> SourceReading:
        msg = "a bug"
        raise ZeroDivisionError(msg)

    async def close(self) -> None:
        return None


async def test_a_row_sums_its_pdus_and_goes_partial_when_one_fails(
    snmpsim_own: SnmpSimProcess,
) -> None:
    a = SnmpSource(SnmpSourceConfig.model_validate(_snmp(snmpsim_own, "pdu-a")), community="apc")
    b = SnmpSource(
        SnmpSourceConfig.model_validate(_snmp(snmpsim_own, "pdu-b")), community="raritan"
    )
    row = MeterRow("row1", TOPIC, (a, b))
    out, book = Collect(), SourceLog()
    try:
        [(_, whole)] = await meter_once(out, [row], sources_log=book, read_timeout_s=2.0)
        assert whole.power_w == pytest.approx(5230.0 + 2716.0)
        assert not whole.partial
        assert out.messages[-1].topic == TOPIC
        assert not out.messages[-1].retain
        assert decode(out.messages[-1].payload, Meter) == whole
        await asyncio.to_thread(snmpsim_own.stop)
        [(_, half)] = await meter_once(out, [row], sources_log=book, read_timeout_s=2.0)
        assert half.partial
        assert set(half.missing) == {"pdu-a", "pdu-b"}
        assert book.failing() == ["row1/pdu-a", "row1/pdu-b"]
        await asyncio.to_thread(snmpsim_own.start)
        [(_, back)] = await meter_once(out, [row], sources_log=book, read_timeout_s=2.0)
        assert not back.partial
        assert book.failing() == []
    finally:
        await a.close()
        await b.close()


async def test_a_readers_bug_costs_one_reading_not_the_service() -> None:
    drops = DropLog("meter_read_failed")
    result = await read_source(Broken(), timeout_s=1.0, internal=drops)
    assert isinstance(result, SourceFailure)
    assert result.reason == "internal"
    assert drops.counts["internal"] == 1


async def test_a_slow_source_is_a_timeout_within_the_bound() -> None:
    class Slow:
        name = "slow"

        async def read(self) -> SourceReading:
            await asyncio.sleep(10)
            msg = "never"
            raise ReadingRejectedError(msg, reason="nan")  # pragma: no cover

        async def close(self) -> None:
            return None

    started = time.monotonic()
    result = await read_source(Slow(), timeout_s=0.2)
    assert isinstance(result, SourceFailure)
    assert result.reason == "timeout"
    assert time.monotonic() - started < 2.0


async def test_each_row_is_published_when_its_own_sources_have_answered() -> None:
    """A row whose device has not answered does not hold back another row's reading (a
    feed's trip reaches the aggregator after its own row's reads): the slow PDU answers
    only once the fast row's reading is out."""
    fast_out = asyncio.Event()

    class Waiting:
        def __init__(self, name: str, until: asyncio.Event | None) -> None:
            self.name, self.until = name, until

        async def read(self) -> SourceReading:
            if self.until is not None:
                await self.until.wait()
            return SourceReading(1000.0, "device power", equipment="up")

        async def close(self) -> None:
            return None

    class Signalling(Collect):
        def publish_nowait(self, msg: OutMessage) -> None:
            super().publish_nowait(msg)
            fast_out.set()

    bus = Signalling()
    rows = [
        MeterRow("slow", "polca/v1/dc1/slow/meter", (Waiting("pdu-s", fast_out),)),
        MeterRow("fast", "polca/v1/dc1/fast/meter", (Waiting("pdu-f", None),)),
    ]
    published = await asyncio.wait_for(
        meter_once(bus, rows, sources_log=SourceLog(), read_timeout_s=30.0), timeout=20.0
    )
    assert [m.topic for m in bus.messages] == [
        "polca/v1/dc1/fast/meter",
        "polca/v1/dc1/slow/meter",
    ]
    assert [row.row for row, _ in published] == ["slow", "fast"]  # in the rows' order
    assert decode(bus.messages[0].payload, Meter).states["pdu-f"].equipment == "up"


def _config(tmp_path: Path, broker: MosquittoProcess, agent: SnmpSimProcess) -> Path:
    community = tmp_path / "community"
    community.write_text("apc\n", encoding="utf-8")
    raritan = tmp_path / "community-b"
    raritan.write_text("raritan\n", encoding="utf-8")
    config = {
        "mqtt": {"host": broker.host, "port": broker.port},
        "site": "dc1",
        "interval_s": 0.5,
        "rows": [
            {
                "row": "row1",
                "sources": [
                    _snmp(agent, "pdu-a") | {"community_file": str(community)},
                    _snmp(agent, "pdu-b") | {"community_file": str(raritan)},
                ],
            }
        ],
        "logging": {"format": "json", "level": "info"},
    }
    path = tmp_path / "meter.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


async def test_polca_meter_run_publishes_the_rows_power_and_says_when_it_is_partial(
    tmp_path: Path, mosquitto: MosquittoProcess, snmpsim_own: SnmpSimProcess
) -> None:
    config = _config(tmp_path, mosquitto, snmpsim_own)
    readings: list[tuple[Meter, bool]] = []
    async with aiomqtt.Client(mosquitto.host, mosquitto.port) as client:
        await client.subscribe(TOPIC)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "polca", "meter", "run", "--config", str(config),
            stdout=PIPE, stderr=PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:

            async def collect(until: Any) -> None:
                async for message in client.messages:
                    meter = decode(bytes(message.payload), Meter)
                    assert isinstance(meter, Meter)
                    readings.append((meter, message.retain))
                    if until(meter):
                        return

            async with asyncio.timeout(30):
                await collect(lambda m: not m.partial)
            assert readings[-1][0].power_w == pytest.approx(5230.0 + 2716.0)
            assert readings[-1][1] is False  # live readings are never retained
            await asyncio.to_thread(snmpsim_own.stop)
            async with asyncio.timeout(30):
                await collect(lambda m: m.partial)
            assert set(readings[-1][0].missing) == {"pdu-a", "pdu-b"}
            await asyncio.sleep(2.0)  # several more failed polls: logged once, not each time
        finally:
            proc.terminate()
            _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0
    events = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "meter_started" in names
    failed = [e for e in events if e["event"] == "meter_source_failed"]
    assert {e["source"] for e in failed} == {"row1/pdu-a", "row1/pdu-b"}
    # Once per outage and reason (an SNMP timeout or the read's bound), not once per poll.
    assert len(failed) <= 4
    polls = sum(1 for m, _ in readings if m.partial)
    assert polls >= 1


def test_once_prints_one_round_and_fails_when_partial(
    tmp_path: Path, mosquitto: MosquittoProcess, snmpsim_own: SnmpSimProcess
) -> None:
    config = _config(tmp_path, mosquitto, snmpsim_own)
    ok = subprocess.run(
        [sys.executable, "-m", "polca", "meter", "run", "--config", str(config), "--once"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["row1"]["power_w"] == pytest.approx(5230.0 + 2716.0)
    assert out["row1"]["topic"] == TOPIC
    snmpsim_own.stop()
    partial = subprocess.run(
        [sys.executable, "-m", "polca", "meter", "run", "--config", str(config), "--once"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert partial.returncode == 1
    assert json.loads(partial.stdout)["row1"]["partial"] is True


def test_a_config_without_rows_fails_with_78(tmp_path: Path) -> None:
    path = tmp_path / "meter.yaml"
    path.write_text("site: dc1\n", encoding="utf-8")
    bad = subprocess.run(
        [sys.executable, "-m", "polca", "meter", "run", "--config", str(path), "--once"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 78
    assert "rows" in bad.stderr
