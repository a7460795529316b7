"""Fixtures of the telemetry tests: the 3-node NATS cluster (the single Mosquitto comes
from tests/conftest.py)."""

from tests.nats_cluster import nats_cluster, nats_cluster_factory

__all__ = ["nats_cluster", "nats_cluster_factory"]
