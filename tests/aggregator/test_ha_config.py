"""The ``ha`` settings: refused when they could not keep the agents' leases alive."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from polca.aggregator.config import AggregatorSettings
from polca.errors import ConfigError
from polca.settings import load_settings_as

ROWS = [{"name": "row1", "budget_w": 1000, "racks": [{"name": "r1", "nodes": [{"name": "n1"}]}]}]


def _load(tmp_path: Path, config: dict[str, object]) -> AggregatorSettings:
    path = tmp_path / "aggregator.yaml"
    path.write_text(yaml.safe_dump({"rows": ROWS, **config}), encoding="utf-8")
    return load_settings_as(AggregatorSettings, path)


@pytest.mark.parametrize(
    ("mqtt", "control", "lease_s"),
    [
        ({}, {}, 10.0),  # one broker
        ({"endpoints": ["mq1", "mq2", "mq3"]}, {}, 30.0),  # a cluster: elections to ride out
        ({"endpoints": ["mq1"]}, {}, 10.0),
        ({"endpoints": ["mq1", "mq2"]}, {"lease_s": 12}, 12.0),  # set: as set
    ],
)
def test_the_control_lease_defaults_by_the_broker(
    tmp_path: Path, mqtt: dict[str, object], control: dict[str, object], lease_s: float
) -> None:
    settings = _load(tmp_path, {"mqtt": mqtt, "control": control})
    assert settings.lease_s == lease_s


def test_the_ha_check_uses_the_cluster_lease(tmp_path: Path) -> None:
    """A ttl of 12 s fits the 30 s lease of a cluster, not the 10 s of one broker."""
    ha = {"etcd_endpoints": ["http://127.0.0.1:2379"], "lease_ttl_s": 12}
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        _load(tmp_path, {"ha": ha})
    ok = _load(tmp_path, {"ha": ha, "mqtt": {"endpoints": ["mq1", "mq2"]}})
    assert ok.lease_s == 30.0


def test_without_endpoints_the_aggregator_runs_alone(tmp_path: Path) -> None:
    settings = _load(tmp_path, {})
    assert not settings.ha.enabled
    assert settings.shard == "row1"


def test_an_etcd_ttl_over_half_the_control_lease_is_refused(tmp_path: Path) -> None:
    """A standby must lead before the agents' leases end: ttl ≤ lease / 2."""
    ha = {"etcd_endpoints": ["http://127.0.0.1:2379"], "lease_ttl_s": 6}
    with pytest.raises((ConfigError, ValueError), match="at most half of"):
        _load(tmp_path, {"ha": ha, "control": {"lease_s": 10}})
    ok = _load(tmp_path, {"ha": {**ha, "lease_ttl_s": 5}, "control": {"lease_s": 10}})
    assert ok.ha.lease_ttl_s == 5


def test_an_endpoint_without_a_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises((ConfigError, ValueError), match="must start with http"):
        _load(tmp_path, {"ha": {"etcd_endpoints": ["etcd1:2379"]}})


def test_the_etcd_password_is_refused_in_the_file(tmp_path: Path) -> None:
    """Secrets come from the environment, a file or a systemd credential, never the YAML."""
    ha = {"etcd_endpoints": ["http://127.0.0.1:2379"], "username": "u", "password": "p"}
    with pytest.raises((ConfigError, ValueError), match=r"ha\.password"):
        _load(tmp_path, {"ha": ha})


def test_the_shipped_ha_example_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/aggregator-ha.example.yaml loads, campaigns, and lists itself among its peers."""
    import os

    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    example = Path(__file__).resolve().parents[2] / "deploy" / "aggregator-ha.example.yaml"
    settings = load_settings_as(AggregatorSettings, example)
    assert settings.ha.enabled
    assert settings.instance in settings.ha.peers
    assert settings.ha.lease_ttl_s * 2 <= settings.lease_s
