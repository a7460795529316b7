"""ModbusCduPoller against pymodbus' own TCP server: decoding, restarts, timeouts, bad maps."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from polca.cdu.config import CduSettings
from polca.cdu.modbus import ModbusCduPoller
from polca.cdu.publisher import publish_poll_once
from polca.cdu.registers import ModbusCduConfig, load_map
from polca.errors import ConfigError, TransportError
from polca.modbus.client import PymodbusClient
from polca.settings import load_settings_as
from polca.telemetry.checks import DropLog
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import CduTelemetry
from tests.modbus.conftest import ModbusTestServer, word16, words32
from tests.mqtt_broker import free_port

EXAMPLE_MAP = Path(__file__).resolve().parents[2] / "deploy" / "cdu-modbus.example.yaml"
WAIT_S = 10.0


def example_config(server: ModbusTestServer, **overrides: Any) -> ModbusCduConfig:
    """The example map of deploy/, pointed at the test server, with fast retries."""
    settings = load_settings_as(CduSettings, EXAMPLE_MAP)
    assert settings.modbus is not None
    values = settings.modbus.model_dump()
    values.update(
        host=server.host,
        port=server.port,
        timeout_s=1.0,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
    )
    values.update(overrides)
    return ModbusCduConfig.model_validate(values)


async def load_example_registers(server: ModbusTestServer) -> None:
    """Register values of a CDU at 86 F supply, 39.6 GPM, pump 1 running, a floor leak."""
    await server.set(
        "input",
        0,
        [
            word16(860),  # supply 86.0 F = 30 C
            word16(1004),  # return 100.4 F = 38 C
            396,  # 39.6 GPM
            2176,  # 21.76 psi
            *words32(80_500.0, "float32"),  # 80.5 kW in W
            word16(716),  # facility 71.6 F = 22 C
            word16(-40),  # -4.0 F = -20 C (a frozen probe, still valid)
            300,  # 30.0 GPM
            555,  # valve 55.5 %
        ],
    )
    await server.set("holding", 100, [1, 700, 2, 0, 0b10, 1])


def check_example_reading(message: CduTelemetry) -> None:
    """Every field of the example map decoded to polca's units."""
    sec = message.secondary
    assert message.cdu == "cdu1"
    assert message.loop == "loop1"
    assert sec.supply_temp_c == pytest.approx(30.0)
    assert sec.return_temp_c == pytest.approx(38.0)
    assert sec.flow_lpm == pytest.approx(39.6 * 3.785411784)
    assert sec.delta_pressure_kpa == pytest.approx(21.76 * 6.894757293168)
    assert sec.heat_removed_kw == pytest.approx(80.5)
    assert message.primary is not None
    assert message.primary.supply_temp_c == pytest.approx(22.0)
    assert message.primary.return_temp_c == pytest.approx(-20.0)
    assert message.primary.flow_lpm == pytest.approx(30.0 * 3.785411784)
    assert message.valve_position_pct == pytest.approx(55.5)
    assert [(p.name, p.state, p.speed_pct) for p in message.pumps] == [
        ("P1", "running", pytest.approx(70.0)),
        ("P2", "standby", 0.0),
    ]
    assert [(d.name, d.state) for d in message.leak_detectors] == [
        ("tray", "ok"),
        ("floor", "critical"),
    ]
    assert message.status == "warning"


@contextlib.asynccontextmanager
async def polling(config: ModbusCduConfig, **kwargs: Any) -> AsyncIterator[ModbusCduPoller]:
    """A poller that is closed afterwards."""
    jitter = random.Random(1)  # noqa: S311 - backoff jitter, not cryptography
    poller = ModbusCduPoller(config, rng=jitter, **kwargs)
    try:
        yield poller
    finally:
        poller.close()


async def poll_until_ok(poller: ModbusCduPoller) -> CduTelemetry:
    """Poll every 20 ms until a poll succeeds (or fail after WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            try:
                return await poller.poll()
            except TransportError:
                await asyncio.sleep(0.02)


async def test_example_map_decodes_every_type_scale_and_unit(
    modbus_server: ModbusTestServer,
) -> None:
    """The example register map reads a real Modbus server correctly, in few requests."""
    await load_example_registers(modbus_server)
    async with polling(example_config(modbus_server)) as poller:
        message = await poller.poll()
        check_example_reading(message)
        # Contiguous registers share a request: one for the input block, one for holding.
        assert [(b.table, b.address, b.count) for b in poller.blocks] == [
            ("holding", 100, 6),
            ("input", 0, 10),
        ]
        assert sorted(modbus_server.reads) == [(3, 100, 6), (4, 0, 10)]
        assert poller.polls == 1
        assert poller.connects == 1
        await modbus_server.set("input", 0, [word16(896)])  # 89.6 F = 32 C
        again = await poller.poll()
        assert again.secondary.supply_temp_c == pytest.approx(32.0)
        assert poller.connects == 1  # the connection is reused


async def test_integer_types_and_word_orders_over_the_wire(
    modbus_server: ModbusTestServer,
) -> None:
    """uint16/int16/uint32/int32/float32 in both word orders decode from the server."""
    await modbus_server.set(
        "holding",
        0,
        [
            65_000,  # uint16
            word16(-1234),  # int16
            *words32(3_000_000, "uint32", word_order="little"),
            *words32(-250_000, "int32"),
            *words32(-12.75, "float32", word_order="little"),
        ],
    )
    config = load_map(
        {
            "cdu": "cdu9",
            "loop": "loop9",
            "host": modbus_server.host,
            "port": modbus_server.port,
            "points": [
                {"field": "secondary.flow_lpm", "address": 0, "scale": 0.01},
                {"field": "secondary.supply_temp_c", "address": 1, "type": "int16", "scale": 0.01},
                {
                    "field": "secondary.heat_removed_kw",
                    "address": 2,
                    "type": "uint32",
                    "word_order": "little",
                    "unit": "w",
                },
                {
                    "field": "secondary.delta_pressure_kpa",
                    "address": 4,
                    "type": "int32",
                    "unit": "pa",
                },
                {
                    "field": "primary.supply_temp_c",
                    "address": 6,
                    "type": "float32",
                    "word_order": "little",
                },
            ],
        }
    )
    async with polling(config) as poller:
        message = await poller.poll()
    assert message.secondary.flow_lpm == pytest.approx(650.0)
    assert message.secondary.supply_temp_c == pytest.approx(-12.34)
    assert message.secondary.heat_removed_kw == pytest.approx(3000.0)
    assert message.secondary.delta_pressure_kpa == pytest.approx(-250.0)
    assert message.primary is not None
    assert message.primary.supply_temp_c == pytest.approx(-12.75)
    assert modbus_server.reads == [(3, 0, 8)]  # one request for all five


async def test_poller_survives_a_server_restart(modbus_server: ModbusTestServer) -> None:
    """Server gone: polls fail (logged once); server back on the same port: polls succeed."""
    await load_example_registers(modbus_server)
    async with polling(example_config(modbus_server)) as poller:
        with capture_logs() as logs:
            check_example_reading(await poller.poll())
            await modbus_server.stop()
            failures = 0
            for _ in range(10):
                with pytest.raises(TransportError):
                    await poller.poll()
                failures += 1
                await asyncio.sleep(0.03)
            assert poller.in_outage
            await modbus_server.start()
            check_example_reading(await poll_until_ok(poller))
            check_example_reading(await poller.poll())
    events = [entry["event"] for entry in logs if entry["log_level"] in ("warning", "info")]
    assert events.count("modbus_unreachable") == 1
    assert events.count("modbus_recovered") == 1
    recovered = next(e for e in logs if e["event"] == "modbus_recovered")
    assert recovered["failed_polls"] >= failures
    assert recovered["outage_s"] > 0
    assert poller.connects == 2
    assert not poller.in_outage


async def test_unreachable_device_backs_off_without_connecting() -> None:
    """While backing off, a poll fails at once with the delay left, without a new client."""
    created: list[PymodbusClient] = []

    def factory(config: ModbusCduConfig) -> PymodbusClient:
        client = PymodbusClient(config)
        created.append(client)
        return client

    config = load_map(
        {
            "cdu": "cdu1",
            "loop": "loop1",
            "host": "127.0.0.1",
            "port": free_port(),
            "reconnect_min_s": 5.0,
            "reconnect_max_s": 5.0,
            "points": [{"field": "secondary.flow_lpm", "address": 0}],
        }
    )
    async with polling(config, client_factory=factory) as poller:
        with pytest.raises(TransportError, match="cannot connect"):
            await poller.poll()
        with pytest.raises(TransportError, match="next attempt in") as caught:
            await poller.poll()
    assert len(created) == 1
    assert 0 < caught.value.delay_s <= 5.0
    assert poller.failures == 2


async def test_read_timeout_is_a_transport_error() -> None:
    """A device that accepts the connection but never answers times out per read."""
    release = asyncio.Event()

    async def mute(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = load_map(
        {
            "cdu": "cdu1",
            "loop": "loop1",
            "host": "127.0.0.1",
            "port": port,
            "timeout_s": 0.3,
            "points": [{"field": "secondary.flow_lpm", "address": 0}],
        }
    )
    loop = asyncio.get_running_loop()
    try:
        async with polling(config) as poller:
            started = loop.time()
            with pytest.raises(TransportError, match="timed out"):
                await poller.poll()
            assert loop.time() - started < 2.0
            assert not poller.connected  # a late answer must not be read as the next one
    finally:
        release.set()
        server.close()
        await server.wait_closed()


async def test_map_beyond_the_device_is_a_config_error(modbus_server: ModbusTestServer) -> None:
    """A register the device does not have: ConfigError naming the fix, not a retry."""
    config = load_map(
        {
            "cdu": "cdu1",
            "loop": "loop1",
            "host": modbus_server.host,
            "port": modbus_server.port,
            "points": [{"field": "secondary.flow_lpm", "address": 4000}],
        }
    )
    async with polling(config) as poller:
        with pytest.raises(ConfigError, match="register map does not fit the device"):
            await poller.poll()


async def test_bad_values_are_left_out_and_logged_once(modbus_server: ModbusTestServer) -> None:
    """An unknown pump code reads as failed and an impossible temperature is dropped."""
    await load_example_registers(modbus_server)
    await modbus_server.set("holding", 100, [7])  # pump 1: unknown state code
    await modbus_server.set("input", 0, [word16(32_000)])  # 3200 F: not a real reading
    async with polling(example_config(modbus_server)) as poller:
        with capture_logs() as logs:
            first = await poller.poll()
            await poller.poll()
            await modbus_server.set("holding", 100, [1])
            await modbus_server.set("input", 0, [word16(860)])
            good = await poller.poll()
    assert first.pumps[0].state == "failed"
    assert first.secondary.supply_temp_c is None
    assert first.secondary.return_temp_c == pytest.approx(38.0)
    assert good.pumps[0].state == "running"
    assert good.secondary.supply_temp_c == pytest.approx(30.0)
    invalid = [e["field"] for e in logs if e["event"] == "modbus_value_invalid"]
    assert sorted(invalid) == ["pumps.0.state", "secondary.supply_temp_c"]
    valid = [e["field"] for e in logs if e["event"] == "modbus_value_valid"]
    assert sorted(valid) == ["pumps.0.state", "secondary.supply_temp_c"]
    assert poller.invalid_values == 4  # two fields, two polls


class ScriptedClient:
    """A RegisterClient whose reads answer from a script of responses (a misbehaving CDU)."""

    def __init__(self, responses: list[list[Any]]) -> None:
        self.responses = responses
        self.closed = 0

    async def connect(self) -> None:
        """Always connects."""

    async def read(self, table: str, address: int, count: int) -> list[Any]:
        """The next scripted response, whatever was asked."""
        del table, address, count
        return self.responses.pop(0)

    def close(self) -> None:
        """Count closes."""
        self.closed += 1


def one_point_config() -> ModbusCduConfig:
    """A map of one 16-bit register with quick retries."""
    return load_map(
        {
            "cdu": "cdu9",
            "loop": "loop9",
            "host": "127.0.0.1",
            "reconnect_min_s": 0.0,
            "reconnect_max_s": 0.0,
            "points": [{"field": "secondary.supply_temp_c", "address": 0, "scale": 0.1}],
        }
    )


@pytest.mark.parametrize(
    ("response", "fragment"),
    [
        ([], "returned 0 registers for a read of 1"),
        ([300, 301], "returned 2 registers for a read of 1"),
        ([70_000], "not a 16-bit word"),
        ([-1], "not a 16-bit word"),
        (["300"], "not a 16-bit word"),
    ],
)
async def test_wrong_responses_are_counted_failures_and_polling_goes_on(
    response: list[Any], fragment: str
) -> None:
    """A response of the wrong size or words fails that poll only; the next poll reads."""
    clients: list[ScriptedClient] = []

    def factory(_config: ModbusCduConfig) -> ScriptedClient:
        clients.append(ScriptedClient([[305]] if clients else [response, [305]]))
        return clients[-1]

    async with polling(one_point_config(), client_factory=factory) as poller:
        with pytest.raises(TransportError, match=fragment):
            await poller.poll()
        assert (poller.bad_responses, poller.failures) == (1, 1)
        assert clients[0].closed == 1  # the framing cannot be trusted: reconnect
        reading = await poll_until_ok(poller)
    assert reading.secondary.supply_temp_c == pytest.approx(30.5)
    assert len(clients) == 2


async def test_an_unexpected_poll_failure_is_logged_and_the_loop_goes_on() -> None:
    """A bug in a poll (not a transport or map problem) costs that poll, logged rate-limited."""
    sent: list[OutMessage] = []

    class Recorder:
        def publish_nowait(self, msg: OutMessage) -> None:
            sent.append(msg)

    script: list[list[Any]] = [[305], [305], [305]]

    class Exploding(ModbusCduPoller):
        calls = 0

        async def poll(self) -> CduTelemetry:
            self.calls += 1
            if self.calls <= 2:
                msg = "bug"
                raise RuntimeError(msg)
            return await super().poll()

    poller = Exploding(one_point_config(), client_factory=lambda _c: ScriptedClient(script))
    failures = DropLog("cdu_poll_failed")
    try:
        with capture_logs() as logs:
            assert await publish_poll_once(Recorder(), poller, site="s", failures=failures) is None
            assert await publish_poll_once(Recorder(), poller, site="s", failures=failures) is None
            good = await publish_poll_once(Recorder(), poller, site="s", failures=failures)
    finally:
        poller.close()
    assert good is not None
    assert len(sent) == 1
    assert failures.counts == {"internal": 2}
    lines = [e for e in logs if e["event"] == "cdu_poll_failed"]
    assert len(lines) == 1  # the second failure falls in the same 10 s window
    assert lines[0]["reason"] == "internal"
    assert isinstance(lines[0]["exc_info"], RuntimeError)
