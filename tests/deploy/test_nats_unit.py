"""deploy/nats/nats-server.service: its own user and store, no capability, a comment on
every directive, systemd's own checks, and agreement with nats-server.conf (the store,
the configuration path, a stop timeout above the lame-duck stop it sends); and what that
stop does on a real cluster running the shipped configuration: the node hands its
JetStream leadership over before it closes its clients, so they connect to another node
at once, where a SIGKILL makes them wait for an election (5 to 10 s measured)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.mqtt_wire import SyncMqtt
from tests.nats_cluster import NatsCluster, nats_cluster, nats_cluster_factory
from tests.systemd_units import (
    CONTAINER_NOISE,
    Unit,
    assert_documented,
    assert_verified,
    exposure,
    parse_unit,
)

__all__ = ["nats_cluster", "nats_cluster_factory"]  # fixtures

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "nats" / "nats-server.service"
CONF = ROOT / "deploy" / "nats" / "nats-server.conf"
AGENT_UNIT = ROOT / "systemd" / "polca-agent.service"
_HOST_NOISE = (re.compile(r"network-online\.target"), CONTAINER_NOISE)


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The parsed unit file."""
    return parse_unit(UNIT.read_text(encoding="utf-8"))


def _conf(key: str) -> str:
    """A top-level or nested ``key: value`` of nats-server.conf (the first), unquoted."""
    match = re.search(rf"(?m)^\s*{re.escape(key)}: (.+)$", CONF.read_text(encoding="utf-8"))
    assert match is not None, key
    return match.group(1).strip().strip('"')


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"([0-9.]+)s", duration)
    assert match is not None, duration
    return float(match.group(1))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ExecStart", "/usr/local/bin/nats-server --config /etc/nats/nats-server.conf"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("KillSignal", "SIGUSR2"),
        ("Restart", "always"),
        ("User", "nats"),
        ("StateDirectory", "nats"),
        ("ConfigurationDirectory", "nats"),
        ("LimitNOFILE", "65536"),
        ("CapabilityBoundingSet", ""),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ],
)
def test_key_directive(unit: Unit, key: str, value: str) -> None:
    """Each key directive is set exactly once, to the documented value."""
    assert unit["Service"].get(key) == [value]


def test_every_directive_is_commented_and_none_trails() -> None:
    """A comment above every KEY=value line, none after one."""
    assert_documented(UNIT.read_text(encoding="utf-8"), at_least=40)


def test_the_unit_agrees_with_the_configuration(unit: Unit) -> None:
    """The store is the unit's State directory, the configuration its Configuration
    directory's, and the stop waits longer than the lame-duck stop it asks for."""
    service = unit["Service"]
    assert _conf("store_dir") == f"/var/lib/{service['StateDirectory'][0]}"
    config = service["ExecStart"][0].split("--config ", 1)[1]
    assert config == f"/etc/{service['ConfigurationDirectory'][0]}/{CONF.name}"
    lame_duck_s = _seconds(_conf("lame_duck_duration"))
    assert _seconds(_conf("lame_duck_grace_period")) < lame_duck_s
    assert float(service["TimeoutStopSec"][0]) >= lame_duck_s + 15
    # One node takes every client when the two others are down: a descriptor for each
    # connection, with room for JetStream's files.
    assert int(service["LimitNOFILE"][0]) >= 2 * int(_conf("max_connections"))


def test_systemd_analyze_verify_is_clean_and_catches_mistakes(tmp_path: Path) -> None:
    """systemd-analyze verify is clean, and reports a misspelt key."""
    text = UNIT.read_text(encoding="utf-8")
    misspelt = ("StateDirectory=nats", "StateDirectry=nats")
    assert_verified(tmp_path, UNIT.name, text, misspelt=misspelt, host_noise=_HOST_NOISE)


def test_security_exposure_is_below_the_agents() -> None:
    """The sandbox scores well below the agent's (which needs the GPUs)."""
    score = exposure(UNIT)
    assert score < 2.0
    assert score < exposure(AGENT_UNIT)


def _connect(cluster: NatsCluster, index: int, client_id: str, timeout_s: float) -> SyncMqtt:
    return SyncMqtt.connect(
        cluster.mqtt_endpoints[index],
        client_id=client_id,
        user=None,
        password=None,
        tls=None,
        timeout_s=timeout_s,
    )


def test_the_lame_duck_stop_hands_over_before_it_closes(nats_cluster: NatsCluster) -> None:
    """SIGUSR2 (the unit's KillSignal) to the node leading the MQTT sessions stream: its
    client is closed, another node leads the stream, and a new client's CONNECT on a
    surviving node is answered at once (it would hang during an election)."""
    cluster = nats_cluster
    leader = cluster.stream_leader("$MQTT_sess")
    client = _connect(cluster, leader, "ldm-victim", 5.0)
    cluster.lame_duck(leader)
    assert not cluster.nodes[leader].running
    with pytest.raises((ConnectionError, OSError)):
        client.next_message("polca/v1/none", wait_s=1.0)  # closed by the node
    client.close()
    survivor = (leader + 1) % len(cluster.nodes)
    began = time.monotonic()
    try:
        fresh = _connect(cluster, survivor, "ldm-fresh", 3.0)  # an election: 5 s or more
    except TimeoutError as exc:
        msg = f"CONNECT unanswered after {time.monotonic() - began:.1f} s: no hand-over"
        raise AssertionError(msg) from exc
    fresh.close()
    assert cluster.stream_leader("$MQTT_sess") != leader
