"""RedfishCduPoller, the poll loop and ``polca cdu redfish`` against the stand-in process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from polca.cdu.publisher import publish_poll_once
from polca.cdu.redfish import RedfishCduConfig, RedfishCduPoller
from polca.errors import ConfigError, TransportAuthError, TransportError
from polca.exits import EX_CONFIG
from polca.redfish.api import RedfishEndpoint
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import CduTelemetry, decode
from polca.telemetry.topics import Topics
from tests.cdu.test_cli import ENTRY, drain, listen, run_polca, settle
from tests.mqtt_broker import MosquittoProcess
from tests.services import free_port
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import REPO_ROOT, RedfishStandIn

BASE = "/redfish/v1/ThermalEquipment/CDUs/cdu1"


@pytest.fixture(scope="module")
def _cdus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishStandIn]:
    standin = RedfishStandIn(
        tmp_path_factory.mktemp("cdus"),
        devices=["cdu:cdu1", "cdu:cdu2"],
        username=USERNAME,
        password=PASSWORD,
    )
    standin.start()
    yield standin
    standin.kill()


@pytest.fixture
def cdus(_cdus: RedfishStandIn) -> RedfishStandIn:
    """Two CDUs, cdu1 and cdu2, reset for this test."""
    _cdus.reset()
    return _cdus


def config_for(
    url: str, tmp_path: Path, *, password: str = PASSWORD, **options: Any
) -> RedfishCduConfig:
    """The poller's config for the stand-in at ``url``, with no reconnect delay."""
    password_file = tmp_path / "pw"
    password_file.write_text(password + "\n", encoding="utf-8")
    endpoint = RedfishEndpoint(
        url=url, username=USERNAME, password_file=password_file, allow_http=True, timeout_s=2.0
    )
    return RedfishCduConfig.model_validate(
        {
            "cdu": "cdu1",
            "loop": "loop1",
            "endpoint": endpoint,
            "cdu_id": "cdu1",
            "reconnect_min_s": 0.0,
            "reconnect_max_s": 0.0,
            **options,
        }
    )


class Outbox:
    """A ``Publisher`` that keeps what it is given."""

    def __init__(self) -> None:
        self.messages: list[OutMessage] = []

    def publish_nowait(self, msg: OutMessage) -> None:
        """Keep ``msg``."""
        self.messages.append(msg)


async def test_poll_reads_the_cooling_unit(cdus: RedfishStandIn, tmp_path: Path) -> None:
    """A poll fills the telemetry; later polls GET only the discovered resources."""
    poller = RedfishCduPoller(config_for(cdus.url, tmp_path))
    try:
        telemetry = await poller.poll()
        assert (telemetry.cdu, telemetry.loop, telemetry.status) == ("cdu1", "loop1", "ok")
        assert telemetry.secondary.supply_temp_c == 30.0
        assert telemetry.secondary.flow_lpm == 150.0
        assert [p.state for p in telemetry.pumps] == ["running", "standby"]
        assert [d.state for d in telemetry.leak_detectors] == ["ok", "ok"]
        assert poller.last is not None
        assert poller.last.cooling_capacity_w == 100_000
        cdus.clear_log()
        cdus.set_state("cdu1", supply_c=31.5, pumps={"1": "failed", "2": "running"})
        telemetry = await poller.poll()
        assert telemetry.secondary.supply_temp_c == 31.5
        assert [p.state for p in telemetry.pumps] == ["failed", "running"]
        paths = [r["path"] for r in cdus.requests()]
        assert paths[0] == f"{BASE}/LeakDetection"  # the leak first
        assert len(paths) == poller.requests_per_poll
        assert all(p.startswith(BASE) for p in paths)
        assert (poller.connects, poller.discoveries, poller.polls) == (1, 1, 2)
    finally:
        await poller.close()


async def test_leak_is_published_at_the_next_poll(cdus: RedfishStandIn, tmp_path: Path) -> None:
    """A leak appearing between two polls is in the next published message."""
    poller = RedfishCduPoller(config_for(cdus.url, tmp_path))
    outbox = Outbox()
    try:
        assert await publish_poll_once(outbox, poller, site="s1") is not None
        cdus.set_state("cdu1", leak="Critical")
        assert await publish_poll_once(outbox, poller, site="s1") is not None
    finally:
        await poller.close()
    assert [m.topic for m in outbox.messages] == [Topics().cdu("s1", "cdu1")] * 2
    before, after = (decode(m.payload, CduTelemetry) for m in outbox.messages)
    assert isinstance(before, CduTelemetry)
    assert isinstance(after, CduTelemetry)
    assert {d.name: d.state for d in before.leak_detectors} == {"Tray": "ok", "Floor": "ok"}
    assert {d.name: d.state for d in after.leak_detectors} == {"Tray": "critical", "Floor": "ok"}


async def test_outage_logged_once_and_its_end_once(cdus: RedfishStandIn, tmp_path: Path) -> None:
    """5xx answers: TransportError, one warning for the outage, one line when it ends."""
    poller = RedfishCduPoller(config_for(cdus.url, tmp_path))
    try:
        await poller.poll()
        cdus.fault("error500")
        with capture_logs() as logs:
            for _ in range(3):
                with pytest.raises(TransportError):
                    await poller.poll()
            assert poller.in_outage
            assert not poller.connected
            cdus.fault("none")
            await poller.poll()
        events = [e["event"] for e in logs if e["log_level"] in {"warning", "info"}]
        assert events.count("redfish_cdu_unreachable") == 1
        assert events.count("redfish_cdu_recovered") == 1
        assert not poller.in_outage
        assert poller.discoveries == 2  # found again after the outage
    finally:
        await poller.close()


async def test_backoff_between_connection_attempts(tmp_path: Path) -> None:
    """While nothing answers, polls within the backoff raise without touching the network."""
    config = config_for(f"http://127.0.0.1:{free_port()}", tmp_path).model_copy(
        update={"reconnect_min_s": 30.0, "reconnect_max_s": 30.0}
    )
    poller = RedfishCduPoller(config)
    with pytest.raises(TransportError):
        await poller.poll()
    with pytest.raises(TransportError, match="next attempt in") as caught:
        await poller.poll()
    assert caught.value.delay_s > 10
    await poller.close()


async def test_invalid_value_logged_once_until_good(cdus: RedfishStandIn, tmp_path: Path) -> None:
    """A bad reading is left out and logged once; its return to good is logged once."""
    poller = RedfishCduPoller(config_for(cdus.url, tmp_path))
    connector = f"{BASE}/SecondaryCoolantConnectors/1"
    try:
        with capture_logs() as logs:
            cdus.set_state("cdu1", raw={connector: {"FlowLitersPerMinute": {"Reading": "fast"}}})
            first = await poller.poll()
            second = await poller.poll()
            cdus.set_state("cdu1", raw={connector: {"FlowLitersPerMinute": {"Reading": 99.0}}})
            third = await poller.poll()
    finally:
        await poller.close()
    assert first.secondary.flow_lpm is None
    assert second.secondary.flow_lpm is None
    assert third.secondary.flow_lpm == 99.0
    invalid = [e for e in logs if e["event"] == "redfish_value_invalid"]
    assert [(e["field"], e["reason"]) for e in invalid] == [("secondary.flow_lpm", "type")]
    assert [e["field"] for e in logs if e["event"] == "redfish_value_valid"] == [
        "secondary.flow_lpm"
    ]
    assert poller.invalid_values == 2


async def test_which_cdu(cdus: RedfishStandIn, tmp_path: Path) -> None:
    """Two CDUs need cdu_id; an unknown id is a ConfigError naming the ones there."""
    for cdu_id, match in ((None, "set cdu_id"), ("cdu7", "has no CDU 'cdu7'")):
        poller = RedfishCduPoller(config_for(cdus.url, tmp_path, cdu_id=cdu_id))
        with pytest.raises(ConfigError, match=match):
            await poller.poll()
        await poller.close()
    poller = RedfishCduPoller(config_for(cdus.url, tmp_path, cdu="b", cdu_id="cdu2"))
    cdus.set_state("cdu2", return_c=44.0)
    try:
        assert (await poller.poll()).secondary.return_temp_c == 44.0
    finally:
        await poller.close()


async def test_rejected_credentials_end_the_loop(cdus: RedfishStandIn, tmp_path: Path) -> None:
    """A wrong password is fatal: publish_poll_once lets it through, nothing is published."""
    poller = RedfishCduPoller(config_for(cdus.url, tmp_path, password="wrong"))  # noqa: S106
    outbox = Outbox()
    with pytest.raises(TransportAuthError):
        await publish_poll_once(outbox, poller, site="s1")
    await poller.close()
    assert outbox.messages == []


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``polca ARGV`` (the cdu commands) in a child process."""
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )


def write_settings(path: Path, redfish: dict[str, Any] | None) -> Path:
    """A ``polca cdu`` settings file with a ``redfish:`` section (or none)."""
    settings: dict[str, Any] = {"site": "s1", "mqtt": {"host": "127.0.0.1", "port": free_port()}}
    if redfish is not None:
        settings["redfish"] = redfish
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


async def test_cli_once(standin_factory: Callable[..., RedfishStandIn], tmp_path: Path) -> None:
    """polca cdu redfish --once prints one reading (0), 1 when unreachable, 78 misconfigured."""
    standin = standin_factory(devices=["cdu:cdu1"])
    standin.set_state("cdu1", leak="Critical")
    section: dict[str, Any] = {
        "cdu": "cdu9",
        "loop": "loop2",
        "endpoint": {"url": standin.url, "allow_http": True},
    }
    good = write_settings(tmp_path / "good.yaml", section)
    done = await asyncio.to_thread(run_cli, "cdu", "redfish", "--config", str(good), "--once")
    assert done.returncode == 0, done.stderr
    printed = decode(done.stdout.encode(), CduTelemetry)
    assert isinstance(printed, CduTelemetry)
    assert (printed.cdu, printed.loop) == ("cdu9", "loop2")
    assert printed.leak_detectors[0].state == "critical"

    gone = {**section, "endpoint": {"url": f"http://127.0.0.1:{free_port()}", "allow_http": True}}
    down = write_settings(tmp_path / "down.yaml", gone)
    done = await asyncio.to_thread(run_cli, "cdu", "redfish", "--config", str(down), "--once")
    assert done.returncode == 1, done.stderr

    for name, bad in (("none.yaml", None), ("id.yaml", {**section, "cdu_id": "nope"})):
        path = write_settings(tmp_path / name, bad)
        done = await asyncio.to_thread(run_cli, "cdu", "redfish", "--config", str(path), "--once")
        assert done.returncode == EX_CONFIG, done.stderr


async def test_redfish_command_publishes_and_a_leak_arrives(
    mosquitto: MosquittoProcess,
    standin_factory: Callable[..., RedfishStandIn],
    tmp_path: Path,
) -> None:
    """polca cdu redfish publishes every poll; a leak set mid-run reaches MQTT."""
    standin = standin_factory(devices=["cdu:cdu1"])
    raw: dict[str, Any] = {
        "mqtt": {"host": "127.0.0.1", "port": mosquitto.port, "reconnect_min_s": 0.05},
        "site": "s1",
        "interval_s": 0.1,
        "logging": {"level": "info", "format": "json"},
        "redfish": {
            "cdu": "cdu4",
            "loop": "loop4",
            "endpoint": {"url": standin.url, "allow_http": True},
        },
    }
    config = tmp_path / "cdu.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    bus, task = await listen(mosquitto.port, Topics().cdu("s1", "cdu4"))
    try:
        command = asyncio.create_task(
            run_polca("cdu", "redfish", "--config", str(config), "--duration", "6")
        )
        # The leak is set once the poller has published (not after a fixed sleep: on a
        # loaded machine the command may take longer than that to start).
        before: list[CduTelemetry] = []
        async with asyncio.timeout(20):
            while len(before) < 3:
                await asyncio.sleep(0.05)
                before += drain(bus)
        await asyncio.to_thread(standin.set_state, "cdu1", leak="Critical")
        code, err = await command
        messages = before + await settle(bus)
    finally:
        await bus.close(timeout_s=1.0)
        await task
    assert code == 0, err
    assert "cdu_poller_started" in err
    assert len(messages) >= 5
    assert messages[0].leak_detectors[0].state == "ok"
    assert messages[-1].leak_detectors[0].state == "critical"
    assert all(m.cdu == "cdu4" for m in messages)
