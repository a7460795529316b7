"""Fixtures of the end-to-end agent tests: an 8-GPU A100 fake node and a real broker (one
Mosquitto, or for ``broker`` also the 3-node NATS cluster)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.fake_nvml import FakeNvml
from tests.integration.rig import AgentProcess, Broker, ClusterBroker
from tests.mqtt_broker import MosquittoProcess
from tests.nats_cluster import NatsCluster, nats_cluster, nats_cluster_factory

__all__ = ["a100_node", "agent_factory", "broker", "nats_cluster", "nats_cluster_factory"]


@pytest.fixture(params=["mosquitto", "nats-cluster"])
def broker(request: pytest.FixtureRequest) -> Broker:
    """The core scenarios' broker: one Mosquitto, then the 3-node NATS cluster (every
    process given the three endpoints)."""
    if request.param == "mosquitto":
        mosquitto: MosquittoProcess = request.getfixturevalue("mosquitto")
        return mosquitto
    cluster: NatsCluster = request.getfixturevalue("nats_cluster")
    return ClusterBroker.of(cluster)


@pytest.fixture
def a100_node(tmp_path: Path, fake_nvml_lib: Path) -> FakeNvml:
    """Eight fake A100s, high priority on GPUs 0-1 per the shipped A100 policy."""
    directory = tmp_path / "nvml"
    directory.mkdir()
    return FakeNvml(directory, gpus=8, model="NVIDIA A100-SXM4-80GB", lib_path=fake_nvml_lib)


class AgentFactory(Protocol):
    """Makes an agent on the test's fake node and broker."""

    def __call__(
        self, *, policy: Path = ..., observe_only: bool = ..., startup_grace_s: float = ...
    ) -> AgentProcess:
        """A new, not yet started agent."""
        ...


@pytest.fixture
def agent_factory(
    tmp_path: Path, a100_node: FakeNvml, mosquitto: MosquittoProcess
) -> Iterator[AgentFactory]:
    """Build agents on the fake node and broker; every agent is killed after the test."""
    made: list[AgentProcess] = []

    def make(**kwargs: Any) -> AgentProcess:
        agent = AgentProcess(tmp_path / "agent", fake=a100_node, broker=mosquitto, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.kill()
