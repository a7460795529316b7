"""deploy/compose.yaml, checked statically (no container engine in CI).

The stack must refer only to files that exist in the repository, publish ports on the
host's loopback only, run agents that are nodes of the aggregator's example topology with
settings polca accepts, and configure the broker like deploy/mosquitto/mosquitto.conf.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from polca.agent.config import load_settings
from polca.aggregator.config import AggregatorSettings
from polca.settings import load_settings_as

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
EXAMPLE_CONFIG = DEPLOY / "aggregator.example.yaml"
MOSQUITTO_CONF = DEPLOY / "mosquitto" / "mosquitto.conf"
COMPOSE_CONF = DEPLOY / "mosquitto" / "compose.conf"
GRAFANA_PROVIDER = DEPLOY / "grafana" / "provisioning" / "dashboards" / "polca.yaml"

Service = dict[str, Any]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The parsed compose file (YAML merge keys resolved)."""
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Service]:
    """Service name -> definition."""
    result = compose["services"]
    assert isinstance(result, dict)
    return result


@pytest.fixture(scope="module")
def agents(services: dict[str, Service]) -> dict[str, Service]:
    """The simulated node agents: services whose command is ``agent``."""
    return {name: svc for name, svc in services.items() if svc.get("command", [None])[0] == "agent"}


@pytest.fixture(scope="module")
def topology() -> dict[str, tuple[str, str, str]]:
    """node -> (site, row, rack) for every node of the example aggregator configuration."""
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    return {
        node["name"]: (config["site"], row["name"], rack["name"])
        for row in config["rows"]
        for rack in row["racks"]
        for node in rack["nodes"]
    }


def _mounts(service: Service) -> list[tuple[str, str]]:
    """(source, target) of each short-syntax volume entry."""
    result = []
    for entry in service.get("volumes", []):
        assert isinstance(entry, str), f"use the short volume syntax: {entry!r}"
        source, target, *_ = entry.split(":")
        result.append((source, target))
    return result


def _directives(path: Path) -> dict[str, list[str]]:
    """Active Mosquitto directives: key -> values in order."""
    result: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition(" ")
            result.setdefault(key, []).append(value)
    return result


def test_stack_has_every_service(services: dict[str, Service]) -> None:
    """Broker (with its user setup), database, dashboards, aggregator and agents."""
    assert {"mosquitto-init", "mosquitto", "influxdb", "grafana", "aggregator"} <= set(services)
    assert services["mosquitto"]["image"] == "eclipse-mosquitto:2"
    assert services["influxdb"]["image"] == "influxdb:1.8"
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def test_polca_services_do_not_restart_forever_on_a_fatal_exit(
    services: dict[str, Service],
) -> None:
    """Exit 78 is a configuration problem a restart cannot fix (systemd's units say
    RestartPreventExitStatus=78); compose cannot exempt one exit code, so the polca
    services restart on failure a bounded number of times, never forever."""
    polca = {name: s for name, s in services.items() if s.get("image") == "polca:local"}
    assert "aggregator" in polca
    for name, service in polca.items():
        policy = str(service.get("restart", "no"))
        kind, _, retries = policy.partition(":")
        assert kind == "on-failure", (name, policy)
        assert retries.isdigit(), (name, policy)
        assert 0 < int(retries) <= 10, (name, policy)


def test_images_are_pinned_or_built(services: dict[str, Service]) -> None:
    """Every image has an explicit tag other than latest; polca's is built from the repo."""
    for name, service in services.items():
        image = service["image"]
        assert ":" in image, name
        assert not image.endswith(":latest"), name
        if image.startswith("polca:"):
            assert service["build"] == {"context": "..", "dockerfile": "Dockerfile"}, name


def test_host_paths_exist(services: dict[str, Service], compose: dict[str, Any]) -> None:
    """Every bind mount names a file or directory of the repository; volumes are declared."""
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for source, _ in _mounts(service):
            if source.startswith((".", "/")):
                path = (DEPLOY / source).resolve()
                assert path.exists(), f"{name}: {source} does not exist"
                assert path.is_relative_to(ROOT), f"{name}: {source} is outside the repository"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
        build = service.get("build")
        if build is not None:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name


def test_ports_bind_loopback_only(services: dict[str, Service]) -> None:
    """Published ports listen on the host's 127.0.0.1, never on every interface."""
    published = [
        (name, str(port)) for name, svc in services.items() for port in svc.get("ports", [])
    ]
    assert published, "the stack publishes no port at all"
    for name, port in published:
        assert port.startswith("127.0.0.1:"), f"{name}: {port}"
    assert {name for name, _ in published} == {"mosquitto", "influxdb", "grafana"}


def test_agents_are_nodes_of_the_example_topology(
    agents: dict[str, Service], topology: dict[str, tuple[str, str, str]]
) -> None:
    """Every agent's site/row/rack/node is a node of aggregator.example.yaml, and back."""
    assert 2 <= len(agents) <= 4
    placed: dict[str, tuple[str, str, str]] = {}
    for name, agent in agents.items():
        env = agent["environment"]
        node = env["POLCA_TOPICS__NODE"]
        where = (env["POLCA_TOPICS__SITE"], env["POLCA_TOPICS__ROW"], env["POLCA_TOPICS__RACK"])
        assert topology.get(node) == where, f"{name}: {node} at {where} is not in the topology"
        placed[node] = where
    assert placed == topology
    assert len({rack for _, _, rack in placed.values()}) == 2


def test_agents_run_simulated_with_their_own_broker_user(
    agents: dict[str, Service], services: dict[str, Service]
) -> None:
    """Simulated GPUs; user name = node name (the pattern ACL); a password the init made."""
    users = services["mosquitto-init"]["command"]
    for name, agent in agents.items():
        env = agent["environment"]
        node = env["POLCA_TOPICS__NODE"]
        assert agent["command"] == ["agent", "--backend", "simulated"], name
        assert env["POLCA_MQTT__HOST"] == "mosquitto", name
        assert env["POLCA_MQTT__USERNAME"] == node, name
        assert env["POLCA_MQTT__PASSWORD_FILE"] == f"/run/polca-secrets/{node}.pass", name
        assert node in users, name
        assert ("mqtt-secrets", "/run/polca-secrets") in _mounts(agent), name
    seeds = [agent["environment"]["POLCA_GPU__SIMULATED_SEED"] for agent in agents.values()]
    assert len(set(seeds)) == len(seeds), "every node should get its own load"


def test_agent_environment_is_accepted_by_settings(
    agents: dict[str, Service], monkeypatch: pytest.MonkeyPatch
) -> None:
    """polca's settings accept each agent's POLCA_* variables and place the node as meant."""
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    for agent in agents.values():
        env = agent["environment"]
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, str(value))
            settings = load_settings()
        assert settings.gpu.backend == "nvml"  # --backend simulated comes from the command
        assert settings.topics.node == env["POLCA_TOPICS__NODE"]
        assert settings.topics.rack == env["POLCA_TOPICS__RACK"]
        assert settings.mqtt.username == env["POLCA_MQTT__USERNAME"]


def test_aggregator_runs_the_example_configuration(services: dict[str, Service]) -> None:
    """``polca aggregator --config`` on aggregator.example.yaml with the demo policy."""
    aggregator = services["aggregator"]
    assert aggregator["command"] == ["aggregator", "--config", "/etc/polca/aggregator.yaml"]
    mounts = {target: source for source, target in _mounts(aggregator)}
    assert mounts["/etc/polca/aggregator.yaml"] == "./aggregator.example.yaml"
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    assert config["policy_file"] in mounts
    assert Path(config["influx"]["spool_dir"]).is_relative_to(
        next(t for t, s in mounts.items() if s == "aggregator-state")
    )
    env = aggregator["environment"]
    assert env["POLCA_MQTT__HOST"] == "mosquitto"
    user = config["mqtt"]["username"]
    assert env["POLCA_MQTT__PASSWORD_FILE"] == f"/run/polca-secrets/{user}.pass"
    assert user in services["mosquitto-init"]["command"]
    assert env["POLCA_INFLUX__URL"] == "http://influxdb:8086"


def test_aggregator_settings_accept_the_example_and_the_environment(
    services: dict[str, Service],
    topology: dict[str, tuple[str, str, str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """aggregator.example.yaml with the aggregator service's POLCA_* variables is valid."""
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    env = services["aggregator"]["environment"]
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    password = tmp_path / "polca-aggregator.pass"
    password.write_text("demo\n", encoding="utf-8")
    monkeypatch.setenv("POLCA_MQTT__PASSWORD_FILE", str(password))
    settings = load_settings_as(AggregatorSettings, EXAMPLE_CONFIG)
    assert settings.mqtt.host == env["POLCA_MQTT__HOST"]
    assert settings.influx.url == env["POLCA_INFLUX__URL"]
    assert settings.mqtt.password is not None
    nodes = {
        node.name: (settings.site, row.name, rack.name)
        for row in settings.rows
        for rack, node in row.nodes()
    }
    assert nodes == topology


def test_dockerfile_entrypoint_is_polca() -> None:
    """Service commands are polca subcommands because the image's entry point is polca."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r'(?m)^ENTRYPOINT \["/opt/polca/bin/polca"\]$', text)


def test_grafana_mounts_match_the_provisioning(services: dict[str, Service]) -> None:
    """Dashboards land where the provider looks; the datasource URL points at influxdb."""
    grafana = services["grafana"]
    mounts = dict(_mounts(grafana))
    provider = yaml.safe_load(GRAFANA_PROVIDER.read_text(encoding="utf-8"))
    assert mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    targets = set(mounts.values())
    assert "/etc/grafana/provisioning/datasources/polca.yaml" in targets
    assert "/etc/grafana/provisioning/dashboards/polca.yaml" in targets
    assert grafana["environment"]["POLCA_INFLUX_URL"] == "${POLCA_INFLUX_URL:-http://influxdb:8086}"


def test_broker_files_line_up(services: dict[str, Service]) -> None:
    """The broker reads compose.conf, the ACL and the password file where the init wrote it."""
    broker = {target: source for source, target in _mounts(services["mosquitto"])}
    conf = _directives(COMPOSE_CONF)
    assert broker["/mosquitto/config/mosquitto.conf"] == "./mosquitto/compose.conf"
    assert broker[conf["acl_file"][0]] == "./mosquitto/acl"
    init = services["mosquitto-init"]
    password_file = Path(conf["password_file"][0])
    assert init["environment"]["PASSWORD_FILE"] == str(password_file)
    assert broker[str(password_file.parent)] == "mqtt-passwd"
    assert ("mqtt-passwd", str(password_file.parent)) in _mounts(init)
    assert conf["persistence_location"][0].rstrip("/") in broker
    script = shlex.split(init["entrypoint"][2])[1]
    assert dict(_mounts(init))["./mosquitto/make-passwords.sh"] == script


def test_compose_conf_follows_mosquitto_conf() -> None:
    """compose.conf differs from mosquitto.conf only in listener, paths and pid file."""
    deployed, demo = _directives(MOSQUITTO_CONF), _directives(COMPOSE_CONF)
    differ = {"listener", "password_file", "acl_file", "persistence_location"}
    assert set(deployed) - {"pid_file"} == set(demo)
    for key in set(demo) - differ:
        assert demo[key] == deployed[key], key
    assert demo["listener"] == ["1883"]
