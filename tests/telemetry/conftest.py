"""Fixtures of the telemetry tests: a real Mosquitto per test (see ``tests/mqtt_broker.py``)."""

from tests.mqtt_broker import mosquitto, mosquitto_factory

__all__ = ["mosquitto", "mosquitto_factory"]
