"""deploy/mosquitto: the broker configuration, authentication, TLS, and make-acl.py itself.

What each role may write and read under the pattern ACL and the generated strict ACL is
tested in ``test_mosquitto_roles.py``; the broker rig (deploy configuration, users made by
the folder's scripts, probes) is ``mosquitto_rig.py``.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiomqtt
import pytest
import yaml

from polca.agent.config import load_settings
from tests.deploy.mosquitto_rig import (
    COMPOSE_CONF,
    CONF,
    MAKE_ACL,
    MAKE_PASSWORDS,
    PATTERN_ACL,
    ROOT,
    BrokerFactory,
    brokers,
    connected,
    expected,
    make_passwords,
    node_listener,
    publish_all,
    received,
    run_script,
)
from tests.mqtt_broker import MosquittoProcess, free_port, make_tls_files

EXAMPLE_CONFIG = ROOT / "deploy" / "aggregator.example.yaml"
AGENT_EXAMPLE = ROOT / "deploy" / "agent.example.yaml"

SERVICE_USERS = ("polca-aggregator", "polca-scheduler", "polca-viewer", "meter")
NODE1 = "polca/v1/dc1/row1/rack1/node1"

# make-acl.py's input for the generator tests: node1 and node2 share rack1, node3 is in
# rack2, node9 in row2; loop1 (CDU cdu1) cools rack1 and rack2, loop2 (cdu2) rack9.
TOPOLOGY = """\
site: dc1
policy_file: /etc/polca/policy.yaml
rows:
  - name: row1
    budget_w: 120000
    meter_topic: polca/v1/dc1/row1/meter
    racks:
      - name: rack1
        nodes:
          - {name: node1, non_gpu_w: 1200}
          - {name: node2, non_gpu_w: 1200}
      - name: rack2
        nodes:
          - {name: node3, non_gpu_w: 1200}
  - name: row2
    budget_w: 60000
    meter_topic: pdu/row2
    racks:
      - name: rack9
        nodes:
          - {name: node9, non_gpu_w: 1200}
cooling:
  loops:
    - {name: loop1, cdu: cdu1, racks: [rack1, rack2], heat_capacity_kw: 100, design_flow_lpm: 150}
    - {name: loop2, cdu: cdu2, racks: [rack9], heat_capacity_kw: 50, design_flow_lpm: 80}
"""


@pytest.fixture
def deployed_broker(tmp_path: Path) -> Iterator[BrokerFactory]:
    """Start brokers with the deploy configuration; all are killed after the test."""
    with brokers(tmp_path) as start:
        yield start


@pytest.fixture
def pattern_broker(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> tuple[MosquittoProcess, dict[str, str]]:
    """The pattern ACL, with the service users and nodes node1 and node2."""
    passwords = make_passwords(tmp_path, [*SERVICE_USERS, "node1", "node2"])
    broker = deployed_broker(acl=PATTERN_ACL, password_file=tmp_path / "passwd")
    return broker, passwords


def make_acl(tmp_path: Path, topology: str = TOPOLOGY, *args: str) -> tuple[int, str, str]:
    """Run make-acl.py on ``topology`` with ``args``: exit code, ACL text, stderr."""
    config = tmp_path / "aggregator.yaml"
    config.write_text(topology, encoding="utf-8")
    acl = tmp_path / "acl"
    result = run_script([sys.executable, MAKE_ACL, config, "-o", acl, *args])
    text = acl.read_text(encoding="utf-8") if acl.exists() else ""
    return result.returncode, text, result.stderr


def sections(acl: str) -> dict[str, list[str]]:
    """user -> its ACL lines (comments and blank lines left out)."""
    result: dict[str, list[str]] = {}
    current: list[str] = []
    for line in acl.splitlines():
        if line.startswith("user "):
            current = result.setdefault(line.removeprefix("user "), [])
        elif line and not line.startswith("#"):
            current.append(line)
    return result


# --- Authentication and TLS ----------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "password"),
    [(None, None), ("node1", "wrong"), ("stranger", "whatever")],
    ids=["anonymous", "wrong-password", "unknown-user"],
)
async def test_unauthenticated_clients_are_refused(
    pattern_broker: tuple[MosquittoProcess, dict[str, str]], user: str | None, password: str | None
) -> None:
    """allow_anonymous false and the password file: no way in without a valid password."""
    broker, _ = pattern_broker
    with pytest.raises(aiomqtt.MqttError, match=r"[Nn]ot authori[sz]ed"):
        async with connected(broker, user, password):
            pass


async def test_tls_block_gives_mutual_tls_with_the_certificate_name_as_user(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> None:
    """The commented TLS listener, enabled: a client certificate's CN is the ACL user name."""
    tls = make_tls_files(tmp_path / "pki")
    passwords = make_passwords(tmp_path, ["polca-aggregator"])
    tls_port = free_port()
    enabled = node_listener(tls, tls_port)
    broker = deployed_broker(acl=PATTERN_ACL, password_file=tmp_path / "passwd", extra=enabled)

    context = ssl.create_default_context(cafile=tls.ca_cert)
    context.load_cert_chain(tls.client_cert, tls.client_key)
    own = "polca/v1/dc1/row1/rack1/polca-test-client/telemetry"
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, None, None, port=tls_port, tls_context=context) as node,
    ):
        await aggregator.subscribe("polca/v1/#", qos=1)
        await publish_all(node, [f"{NODE1}/telemetry", own])
        assert await received(aggregator, 1) == expected([own])

    # Without a certificate: with TLS 1.3 the client's handshake completes before the
    # broker checks, and its refusal only ends the wait for CONNACK (a short timeout).
    no_certificate = ssl.create_default_context(cafile=tls.ca_cert)
    with pytest.raises(aiomqtt.MqttError, match="timed out"):
        async with connected(
            broker, None, None, port=tls_port, tls_context=no_certificate, timeout_s=0.5
        ):
            pass


# --- make-acl.py ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "args", "message"),
    [
        (("name: node2", "name: node1"), (), "node 'node1' appears in row row1 rack rack1 and in"),
        (("name: node9", "name: polca-viewer"), (), "user names used twice"),
        (("name: node9", "name: cdu1"), (), "user names used twice (a node or CDU named"),
        (("name: rack9", "name: rack/9"), (), "rack name 'rack/9' is not one topic level"),
        (("name: node9", 'name: "node9\\n"'), (), "node name 'node9\\n' is not one topic"),
        (("dc1/row1/meter", "dc1/+/meter"), (), "must be a plain topic"),
        (("polca/v1/dc1/row1/meter", "$SYS/row1"), (), "must be a plain topic"),
        (("dc1/row1/meter", "dc1/row1/control"), (), "is (or may become) another polca topic"),
        (("dc1/row1/meter", "dc1/cooling/meter"), (), "is (or may become) another polca topic"),
        (("dc1/row1/meter", "dc1/row1/budget"), (), "is (or may become) another polca topic"),
        (("dc1/row1/meter", "dc1/powertree/meter"), (), "is (or may become) another polca"),
        (("pdu/row2", "polca/v1/dc1/row1/meter"), (), "have the same meter topic"),
        (("name: row2", "name: row1"), (), "row 'row1' is listed twice"),
        (("site: dc1", "site: ''"), (), "site name '' is not one topic level"),
        (("name: row2", "name: aggregator"), (), "row name 'aggregator' is reserved"),
        (("name: row2", "name: cooling"), (), "row name 'cooling' is reserved"),
        (("name: row2", "name: powertree"), (), "row name 'powertree' is reserved"),
        (("name: node9", "name: polca-site"), (), "user names used twice"),
        (("name: node9", "name: polca-operator"), (), "user names used twice"),
        (("racks: [rack9]", "racks: [rack8]"), (), "rack 'rack8' must be a rack of exactly one"),
        (("racks: [rack9]", "racks: [rack1]"), (), "rack rack1 is cooled by two loops"),
        (("cdu: cdu2", "cdu: cdu1"), (), "CDU 'cdu1' already drives another loop"),
        (("cdu: cdu2", "cdu: 'cdu:2'"), (), "it is the CDU's MQTT user name"),
        ((), ("--simulated-cdu", "cdu7"), "--simulated-cdu names no CDU of the configuration"),
        ((), ("--aggregator-user", "agg;reboot"), "aggregator user name 'agg;reboot' must be"),
        ((), ("--site-user", "site;reboot"), "site controller user name 'site;reboot' must be"),
        ((), ("--operator-user", "op erator"), "operator user name 'op erator' must be"),
    ],
    ids=[
        "duplicate-node",
        "node-named-like-service",
        "node-named-like-cdu",
        "bad-rack",
        "newline-in-node",
        "wildcard-meter",
        "sys-meter",
        "meter-on-control",
        "meter-under-cooling",
        "meter-on-budget",
        "meter-under-powertree",
        "shared-meter-topic",
        "dup-row",
        "empty-site",
        "reserved-row-aggregator",
        "reserved-row-cooling",
        "reserved-row-powertree",
        "node-named-like-the-site-controller",
        "node-named-like-the-operator",
        "loop-rack-in-no-row",
        "rack-on-two-loops",
        "cdu-twice",
        "cdu-id-not-a-user-name",
        "unknown-simulated-cdu",
        "service-user-not-a-name",
        "site-user-not-a-name",
        "operator-user-not-a-name",
    ],
)
def test_make_acl_refuses_bad_topologies(
    tmp_path: Path, edit: tuple[str, str] | tuple[()], args: Sequence[str], message: str
) -> None:
    """make-acl.py exits 2 naming the problem, and writes no ACL."""
    topology = TOPOLOGY
    if edit:
        assert edit[0] in TOPOLOGY
        topology = TOPOLOGY.replace(edit[0], edit[1], 1)
    code, acl, stderr = make_acl(tmp_path, topology, *args)
    assert (code, acl) == (2, "")
    assert message in stderr


def test_make_acl_keeps_the_old_acl_on_error(tmp_path: Path) -> None:
    """A refused topology leaves the ACL in place untouched, and no partial file."""
    (tmp_path / "acl").write_text("# the ACL in force\n", encoding="utf-8")
    code, acl, _ = make_acl(tmp_path, TOPOLOGY.replace("name: row2", "name: cooling"))
    assert (code, acl) == (2, "# the ACL in force\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["acl", "aggregator.yaml"]


def test_make_acl_takes_root_user_and_instance_from_the_configuration(tmp_path: Path) -> None:
    """topic_root, instance and mqtt.username of the configuration shape the ACL."""
    extra = "topic_root: lab/v1\ninstance: agg7\nmqtt:\n  username: agg-lab\n"
    code, acl, stderr = make_acl(tmp_path, TOPOLOGY + extra)
    assert code == 0, stderr
    users = sections(acl)
    assert "agg-lab" in users
    assert "polca-aggregator" not in users
    assert "topic write lab/v1/dc1/aggregator/agg7/status" in users["agg-lab"]
    assert "topic read lab/v1/dc1/aggregator/agg7/#" in users["polca-viewer"]
    assert "topic write lab/v1/dc1/+/budget" in users["polca-site"]
    assert "topic readwrite lab/v1/dc1/powertree/limit/+" in users["polca-operator"]
    meters = {"polca/v1/dc1/row1/meter", "pdu/row2"}  # as configured, outside the root
    topics = {line.split()[-1] for lines in users.values() for line in lines}
    assert {topic for topic in topics if not topic.startswith("lab/v1/")} == meters
    args = ("--root", "x/v2", "--aggregator-user", "a", "--site-user", "s", "--operator-user", "o")
    code, acl, _ = make_acl(tmp_path, TOPOLOGY + extra, *args)
    assert code == 0
    users = sections(acl)
    assert "topic write x/v2/dc1/row1/policy" in users["a"]
    assert "topic write x/v2/dc1/powertree/state" in users["s"]
    assert "topic read x/v2/dc1/powertree/state" in users["o"]
    assert {"polca-site", "polca-operator"}.isdisjoint(users)


def test_make_acl_leaves_an_unnamed_instance_open(tmp_path: Path) -> None:
    """Without `instance:` (default: the host name) any instance's topics are the aggregator's."""
    code, acl, stderr = make_acl(tmp_path)
    assert code == 0, stderr
    assert sections(acl)["polca-aggregator"][-2:] == [
        "topic write polca/v1/dc1/aggregator/+/status",
        "topic write polca/v1/dc1/aggregator/+/events",
    ]


def test_make_acl_passwd_commands_add_every_user(tmp_path: Path) -> None:
    """The users script adds exactly the ACL's users, services first, and is executable."""
    script = tmp_path / "add-users.sh"
    code, acl, stderr = make_acl(tmp_path, TOPOLOGY, "--passwd-commands", str(script))
    assert code == 0, stderr
    added = re.findall(r"(?m)^add_user (\S+)$", script.read_text(encoding="utf-8"))
    assert added == list(sections(acl))
    assert added[:9] == [
        "polca-aggregator",
        "polca-scheduler",
        "polca-viewer",
        "polca-site",
        "polca-operator",
        "meter-row1",
        "meter-row2",
        "cdu1",
        "cdu2",
    ]
    assert os.access(script, os.X_OK)


def test_make_acl_reads_json_without_pyyaml(tmp_path: Path) -> None:
    """A .json configuration gives the same ACL as the YAML one, with no yaml module at all."""
    code, from_yaml, _ = make_acl(tmp_path)
    assert code == 0
    config = tmp_path / "aggregator.json"
    config.write_text(json.dumps(yaml.safe_load(TOPOLOGY)), encoding="utf-8")
    blocker = tmp_path / "no-yaml"
    blocker.mkdir()
    (blocker / "yaml.py").write_text("raise ImportError('no PyYAML here')\n", encoding="utf-8")
    result = run_script([sys.executable, MAKE_ACL, config], PYTHONPATH=str(blocker))
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace(str(config), "X") == from_yaml.replace(
        str(tmp_path / "aggregator.yaml"), "X"
    )


def test_make_acl_covers_the_example_configuration() -> None:
    """The example aggregator configuration gives a user section for every node in it."""
    result = run_script([sys.executable, MAKE_ACL, EXAMPLE_CONFIG])
    assert result.returncode == 0, result.stderr
    users = re.findall(r"(?m)^user (\S+)$", result.stdout)
    assert users[:6] == [
        "polca-aggregator",
        "polca-scheduler",
        "polca-viewer",
        "polca-site",
        "polca-operator",
        "meter-row1",
    ]
    assert {"node1", "node2", "node3", "node4"} <= set(users)
    assert "topic write polca/v1/dc1/row1/rack2/node3/telemetry" in result.stdout


def test_agent_example_logs_in_as_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """agent.example.yaml is valid, its user is its node, and the node is in the topology."""
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    settings = load_settings(AGENT_EXAMPLE)
    topics = settings.topics
    assert settings.mqtt.username == topics.node
    assert settings.mqtt.tls
    assert settings.mqtt.port == 8883
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    assert topics.site == config["site"]
    placed = {
        node["name"]: (row["name"], rack["name"])
        for row in config["rows"]
        for rack in row["racks"]
        for node in rack["nodes"]
    }
    assert placed[topics.node] == (topics.row, topics.rack)


# --- The files themselves ----------------------------------------------------------


@pytest.mark.parametrize("path", [CONF, COMPOSE_CONF, PATTERN_ACL], ids=lambda p: p.name)
def test_every_line_is_explained(path: Path) -> None:
    """Every setting, active or commented out, follows a comment line that explains it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    directive = re.compile(r"^#?[a-z_]+ \S")
    unexplained = [
        f"{number}: {line}"
        for number, (previous, line) in enumerate(zip(["", *lines], lines, strict=False), 1)
        if directive.match(line) and not (previous.startswith("# ") or previous == "#")
    ]
    assert unexplained == []


def test_config_defaults_are_safe() -> None:
    """Loopback listener, no anonymous access, password and ACL files, persistence on."""
    active = [
        line
        for line in CONF.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert [line for line in active if line.startswith("listener ")] == ["listener 1883 127.0.0.1"]
    for setting in (
        "allow_anonymous false",
        "password_file /etc/mosquitto/passwd",
        "acl_file /etc/mosquitto/acl",
        "persistence true",
        "persistence_location /var/lib/mosquitto/",
        "log_dest stderr",
    ):
        assert setting in active


def test_scripts_are_executable() -> None:
    """The two generators can be run directly, as the README shows."""
    for script in (MAKE_ACL, MAKE_PASSWORDS):
        assert os.access(script, os.X_OK), script
