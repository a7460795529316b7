"""A meter read over Modbus TCP, against pymodbus' own server on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest
from pydantic import ValidationError

from polca.errors import ReadingRejectedError, TransportError
from polca.meter.modbus import ModbusMeterConfig, ModbusMeterSource
from tests.modbus.conftest import ModbusTestServer, words32
from tests.mqtt_broker import free_port


def _config(server: ModbusTestServer, **over: object) -> ModbusMeterConfig:
    raw: dict[str, object] = {
        "protocol": "modbus",
        "name": "switchboard",
        "host": server.host,
        "port": server.port,
        "timeout_s": 0.5,
        "points": [
            {"field": "power.0", "address": 0, "type": "uint32", "unit": "w"},
            {"field": "power.1", "address": 2, "type": "float32", "unit": "kw"},
        ],
    }
    raw.update(over)
    return ModbusMeterConfig.model_validate(raw)


async def test_power_registers_are_read_in_their_units_and_summed(
    modbus_server: ModbusTestServer,
) -> None:
    await modbus_server.set("holding", 0, [*words32(5200, "uint32"), *words32(4.8, "float32")])
    source = ModbusMeterSource(_config(modbus_server))
    try:
        reading = await source.read()
        assert reading.power_w == pytest.approx(10_000.0, abs=0.01)
        assert reading.detail == "sum of 2 power registers"
        assert len(modbus_server.reads) == 1  # contiguous registers: one request
    finally:
        await source.close()


async def test_a_nan_or_negative_register_is_rejected_not_used(
    modbus_server: ModbusTestServer,
) -> None:
    await modbus_server.set(
        "holding", 0, [*words32(100, "uint32"), *words32(float("nan"), "float32")]
    )
    source = ModbusMeterSource(_config(modbus_server))
    try:
        with pytest.raises(ReadingRejectedError) as nan:
            await source.read()
        assert nan.value.reason == "nan"
        signed = _config(
            modbus_server, points=[{"field": "power.0", "address": 4, "type": "int32", "unit": "w"}]
        )
        await modbus_server.set("holding", 4, words32(-5, "int32"))
        negative = ModbusMeterSource(signed)
        with pytest.raises(ReadingRejectedError) as neg:
            await negative.read()
        assert neg.value.reason == "negative"
        await negative.close()
    finally:
        await source.close()


async def test_an_unreachable_meter_is_a_transport_error_and_recovers(
    modbus_server: ModbusTestServer,
) -> None:
    await modbus_server.set("holding", 0, [*words32(700, "uint32"), *words32(0.3, "float32")])
    source = ModbusMeterSource(_config(modbus_server))
    try:
        assert (await source.read()).power_w == pytest.approx(1000.0, abs=0.01)
        await modbus_server.stop()
        with pytest.raises(TransportError):
            await source.read()
        await modbus_server.start()
        assert (await source.read()).power_w == pytest.approx(1000.0, abs=0.01)
    finally:
        await source.close()


def test_a_meter_map_takes_power_points_only() -> None:
    with pytest.raises(ValidationError, match="power"):
        ModbusMeterConfig.model_validate(
            {
                "protocol": "modbus",
                "name": "m",
                "host": "h",
                "points": [{"field": "secondary.flow_lpm", "address": 0, "unit": "w"}],
            }
        )
    with pytest.raises(ValidationError, match="unit"):
        ModbusMeterConfig.model_validate(
            {
                "protocol": "modbus",
                "name": "m",
                "host": "h",
                "points": [{"field": "power.0", "address": 0}],
            }
        )


async def _polca(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``polca`` in a subprocess without blocking the loop (the server runs on it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "polca", *args, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def test_the_probe_reads_one_register_and_prints_one_json_object(
    modbus_server: ModbusTestServer,
) -> None:
    await modbus_server.set("holding", 10, words32(1234, "uint32"))
    url = f"modbus://{modbus_server.host}:{modbus_server.port}"
    ok = await _polca("meter", "probe", url, "--register", "10")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["power_w"] == 1234.0
    assert "register 10" in out["source"]
    missing = await _polca("meter", "probe", url)
    assert missing.returncode == 78
    assert missing.stderr.count("\n") == 1
    assert "--register" in missing.stderr
    dead_url = f"modbus://127.0.0.1:{free_port()}"
    dead = await _polca("meter", "probe", dead_url, "--register", "0", "--timeout", "0.5")
    assert dead.returncode == 69, dead.stderr
    assert dead.stderr.count("\n") == 1
    assert "Traceback" not in dead.stderr


def test_unknown_url_schemes_fail_with_one_line(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "polca", "meter", "probe", "ftp://x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert bad.returncode == 78
    assert bad.stderr.count("\n") == 1
