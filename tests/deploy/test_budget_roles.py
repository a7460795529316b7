"""``polca budget set`` on the shipped broker configuration: the operator role's limit is
taken, any other user's is refused by the broker and the command says so (exit 77).

A real Mosquitto runs ``deploy/mosquitto/mosquitto.conf`` with the pattern ACL and users
made by ``make-passwords.sh`` (``mosquitto_rig``); ``polca-site`` publishes the retained
site report the command checks the limit against, as the site controller does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from polca.telemetry.schema import DomainReport, SiteReport, encode
from tests.deploy import mosquitto_rig as rig
from tests.mqtt_broker import MosquittoProcess

USERS = ("polca-site", "polca-operator", "polca-viewer", "polca-aggregator")
REPORT_TOPIC = "polca/v1/dc1/powertree/state"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[MosquittoProcess, dict[str, str]]]:
    """The deploy configuration and pattern ACL, with the roles' users."""
    passwords = rig.make_passwords(tmp_path, USERS)
    with rig.brokers(tmp_path) as start:
        yield start(acl=rig.PATTERN_ACL, password_file=tmp_path / "passwd"), passwords


def _report() -> bytes:
    ups = DomainReport(
        name="ups-a",
        kind="ups",
        rating_w=100_000,
        capacity_w=100_000,
        unlimited_w=100_000,
        budget_w=100_000,
        nominal_w=100_000,
        measured_w=50_000,
    )
    now = time.time_ns()
    return encode(SiteReport(ts_ns=now, issuer="site-a", publishing=True, domains=(ups,)))


def _budget_set(
    tmp_path: Path, broker: MosquittoProcess, user: str, password: str
) -> subprocess.CompletedProcess[str]:
    secret = tmp_path / f"{user}.pass"
    secret.write_text(password + "\n", encoding="utf-8")
    config = tmp_path / f"{user}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "site": "dc1",
                "mqtt": {
                    "host": broker.host,
                    "port": broker.port,
                    "username": user,
                    "password_file": str(secret),
                },
            }
        ),
        encoding="utf-8",
    )
    return subprocess.run(
        [sys.executable, "-m", "polca", "budget", "set", "ups-a", "--watts", "60000",
         "--reason", "UPS-A service", "--timeout", "3", "--config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def test_only_the_operator_role_sets_a_limit(
    tmp_path: Path, broker: tuple[MosquittoProcess, dict[str, str]]
) -> None:
    server, passwords = broker
    async with rig.connected(server, "polca-site", passwords["polca-site"]) as site:
        await site.publish(REPORT_TOPIC, _report(), qos=1, retain=True)
    taken = _budget_set(tmp_path, server, "polca-operator", passwords["polca-operator"])
    assert taken.returncode == 0, taken.stderr
    assert '"by": "polca-operator@' in taken.stdout
    # The viewer reads the report but its limit is dropped by the broker: not taken.
    refused = _budget_set(tmp_path, server, "polca-viewer", passwords["polca-viewer"])
    assert refused.returncode == 77, (refused.stdout, refused.stderr)
    assert refused.stderr.count("\n") == 1
    assert "polca-viewer needs the operator role" in refused.stderr
    # The aggregator may not even read the site's report: nothing to check a limit against.
    blind = _budget_set(tmp_path, server, "polca-aggregator", passwords["polca-aggregator"])
    assert blind.returncode == 69, (blind.stdout, blind.stderr)
    assert "no site report" in blind.stderr
    # What the site controller would read: the operator's limit, nobody else's.
    async with rig.connected(server, "polca-site", passwords["polca-site"]) as site:
        await site.subscribe("polca/v1/dc1/powertree/limit/+", qos=1)
        ((topic, payload),) = await rig.received(site, 1)
    assert topic == "polca/v1/dc1/powertree/limit/ups-a"
    assert b'"by":"polca-operator@' in payload
