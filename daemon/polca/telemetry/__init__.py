"""MQTT telemetry and control: topics, the versioned wire schema, and the bus."""

from polca.telemetry.schema import (
    Assignment,
    Control,
    Event,
    SchemaError,
    State,
    Status,
    Telemetry,
    decode,
    encode,
)
from polca.telemetry.topics import NodeAddress, Topics

__all__ = [
    "Assignment",
    "Control",
    "Event",
    "NodeAddress",
    "SchemaError",
    "State",
    "Status",
    "Telemetry",
    "Topics",
    "decode",
    "encode",
]
