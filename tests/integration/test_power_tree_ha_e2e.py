"""Two site controllers elected on a real 3-member etcd: one publishes, the standby takes
over when it dies, the rows never fall to their fallback, and a budget of the old term is
fenced out.

Real processes: Mosquitto, three etcd members, two ``polca site run`` for one site file, one
``polca aggregator`` whose row takes the site's budgets. The probe is the test's MQTT
client: it watches the budgets and the row's summaries and plays the deposed controller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from polca.telemetry.schema import Budget, RowSummary, encode
from tests.etcd import EtcdCluster
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import ROW, SITE, MqttProbe, mqtt_config, mqtt_probe, wait_until
from tests.integration.test_aggregator_e2e import _test_policy
from tests.integration.test_power_tree_e2e import SiteProcess
from tests.mqtt_broker import MosquittoProcess

BUDGET_W, UPS_W, FALLBACK_W = 10_000.0, 8_000.0, 5_000.0
RACKS = {"rack1": ["node1"]}
NAMES = ("site-a", "site-b")
LEASE_S = 12.0  # half of it bounds a takeover: room for a loaded machine


class Pair:
    """The two site controllers and the aggregator."""

    def __init__(self, tmp_path: Path, broker: MosquittoProcess, etcd: EtcdCluster) -> None:
        self.policy = _test_policy(tmp_path)
        tree = tmp_path / "site.yaml"
        tree.write_text(
            yaml.safe_dump(
                {
                    "rows": {ROW: {"rating_w": BUDGET_W}},
                    "domains": {
                        "ups-a": {
                            "kind": "ups",
                            "rating_w": UPS_W,
                            "supplies": [ROW],
                            "oversubscribed": True,
                        }
                    },
                }
            ),
            encoding="utf-8",
        )
        self.sites = {
            name: SiteProcess(
                tmp_path / name,
                policy=self.policy,
                config={
                    "mqtt": mqtt_config(broker),
                    "site": SITE,
                    "instance": name,
                    "tree_file": str(tree),
                    "interval_s": 0.5,
                    "lease_s": LEASE_S,
                    "ha": {"etcd_endpoints": etcd.endpoints},
                    "logging": {"format": "json", "level": "info"},
                },
            )
            for name in NAMES
        }
        self.aggregator = AggregatorProcess(
            tmp_path / "aggregator", broker=broker, policy=self.policy, racks=RACKS,
            budget_w=BUDGET_W, meter=False,
            extra={"site_budget": {"issuers": list(NAMES)}},
        )  # fmt: skip
        config = yaml.safe_load(self.aggregator.config_path.read_text(encoding="utf-8"))
        config["rows"][0]["fallback_budget_w"] = FALLBACK_W
        self.aggregator.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")

    def start(self) -> None:
        """Both controllers, then the aggregator."""
        for site in self.sites.values():
            site.start()
        self.aggregator.start()

    def kill(self) -> None:
        """Kill every process."""
        for process in (*self.sites.values(), self.aggregator):
            process.kill()


@pytest.fixture
def pair(tmp_path: Path, mosquitto: MosquittoProcess, etcd: EtcdCluster) -> Iterator[Pair]:
    """The processes, killed after the test."""
    made = Pair(tmp_path, mosquitto, etcd)
    yield made
    made.kill()


def _budgets(probe: MqttProbe) -> list[Budget]:
    return [m for m in probe.of("budget") if isinstance(m, Budget)]


def _summaries(probe: MqttProbe) -> list[RowSummary]:
    return [m for m in probe.of("summary") if isinstance(m, RowSummary)]


@pytest.fixture
async def leading(pair: Pair, mosquitto: MosquittoProcess) -> AsyncIterator[MqttProbe]:
    """Everything started and the row on a lease from one of the two."""
    async with mqtt_probe(mosquitto) as probe:
        await asyncio.to_thread(pair.start)
        await pair.aggregator.wait_log("aggregator_warm", timeout_s=30)
        await wait_until(
            lambda: bool(_summaries(probe)) and _summaries(probe)[-1].budget_origin == "lease",
            timeout_s=30,
            what="the row on the site controller's lease",
        )
        yield probe


async def test_the_standby_takes_over_and_no_row_falls_to_its_fallback(
    pair: Pair, leading: MqttProbe
) -> None:
    """SIGKILL the publishing controller: the other publishes at a higher term within a
    few seconds, and the row's summaries never say fallback."""
    probe = leading
    issuers = {b.issuer for b in _budgets(probe)[-4:]}
    assert len(issuers) == 1  # one publishes, the standby does not
    (leader,) = issuers
    (standby,) = [n for n in NAMES if n != leader]
    term = _budgets(probe)[-1].term
    assert term > 0
    seen = len(_summaries(probe))
    pair.sites[leader].kill()
    killed = time.monotonic()
    await wait_until(
        lambda: any(b.issuer == standby for b in _budgets(probe)), timeout_s=15, what="takeover"
    )
    took_s = time.monotonic() - killed
    assert took_s < LEASE_S / 2
    first = next(b for b in _budgets(probe) if b.issuer == standby)
    assert first.term > term
    assert first.budget_w == UPS_W
    await asyncio.sleep(2.0)
    after = _summaries(probe)[seen:]
    assert after
    assert all(s.budget_origin == "lease" for s in after)
    assert all(s.electrical_budget_w == UPS_W for s in after)


async def test_a_budget_of_the_deposed_term_changes_nothing(pair: Pair, leading: MqttProbe) -> None:
    """A live budget under the leader's name but its term less one (a deposed, paused
    controller waking up) is fenced by the aggregator; the row keeps the leader's."""
    probe = leading
    budget = _budgets(probe)[-1]
    now = time.time_ns()
    stale = budget.model_copy(
        update={
            "term": budget.term - 1,
            "seq": budget.seq + 1000,
            "budget_w": 1_000.0,
            "issued_ns": now,
            "ts_ns": now,
            "lease_expires_ns": now + 30 * 1_000_000_000,
        }
    )
    await probe.publish_raw(f"polca/v1/{SITE}/{ROW}/budget", encode(stale))
    await pair.aggregator.wait_log(
        "message_dropped", timeout_s=10, where=lambda e: e.get("reason") == "budget_fenced"
    )
    await asyncio.sleep(1.0)
    assert _summaries(probe)[-1].electrical_budget_w == UPS_W
