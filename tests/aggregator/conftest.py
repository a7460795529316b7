"""Fixtures of the aggregator tests: real InfluxDB 1.x and VictoriaMetrics processes."""

from __future__ import annotations

from tests.tsdb import influxdb1, victoria_metrics

__all__ = ["influxdb1", "victoria_metrics"]
