"""MQTT intake of the aggregator: route each message to its row, count and drop the bad.

Every received message is either applied to exactly one row's state or dropped with a
reason: ``oversized``, ``malformed`` (not JSON or the wrong shape), ``schema_version``,
``topology`` (a node, rack or row this aggregator does not own, or a payload whose node
differs from its topic), or ``foreign_control`` (another issuer controls one of our rows).
Drops are counted per reason and logged once per source topic and reason, so a broken or
hostile publisher cannot flood the log or poison the rollups. No I/O here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from polca.aggregator.rollup import RowTracker
from polca.telemetry.bus import InMessage
from polca.telemetry.schema import (
    MAX_PAYLOAD_BYTES,
    CduTelemetry,
    Control,
    Event,
    Meter,
    SchemaError,
    State,
    Status,
    Telemetry,
    decode,
)
from polca.telemetry.topics import Topics

_log = structlog.get_logger()


@dataclass(slots=True)
class Intake:
    """Decodes and routes messages for the rows one aggregator owns."""

    site: str
    topics: Topics
    trackers: dict[str, RowTracker]
    issuer: str
    on_telemetry: Callable[[str, str, str, Telemetry], None] | None = None
    on_event: Callable[[str, str, str, Event], None] | None = None
    on_retained_control: Callable[[Control], None] | None = None
    on_cdu: Callable[[CduTelemetry, float], None] | None = None
    cdus: tuple[str, ...] = ()
    messages_in: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    _logged: set[tuple[str, str]] = field(default_factory=set)
    _meters: dict[str, str] = field(default_factory=dict)  # topic -> row
    _cdu_topics: dict[str, str] = field(default_factory=dict)  # topic -> CDU id

    def __post_init__(self) -> None:
        for name, tracker in self.trackers.items():
            topic = tracker.spec.meter_topic or self.topics.meter(self.site, name)
            self._meters[topic] = name
        for cdu in self.cdus:
            self._cdu_topics[self.topics.cdu(self.site, cdu)] = cdu

    def subscriptions(self) -> list[tuple[str, int]]:
        """The topic filters this aggregator needs (its rows only, never ``#``)."""
        subs: list[tuple[str, int]] = []
        root = self.topics.root
        for row in self.trackers:
            for channel in ("telemetry", "status", "events"):
                subs.append((f"{root}/{self.site}/{row}/+/+/{channel}", 1))
            subs.append((self.topics.row_control(self.site, row), 1))
            subs.append((f"{root}/{self.site}/{row}/+/control", 1))
        subs.extend((topic, 0) for topic in self._meters)
        subs.extend((topic, 0) for topic in self._cdu_topics)
        return subs

    def handle(self, message: InMessage, now_s: float) -> None:
        """Apply one message to its row, or count and drop it."""
        self.messages_in += 1
        if len(message.payload) > MAX_PAYLOAD_BYTES:
            self._drop(message.topic, "oversized", f"{len(message.payload)} bytes")
            return
        if message.topic in self._meters:
            self._meter(message, now_s)
            return
        if message.topic in self._cdu_topics:
            self._cdu(message, now_s)
            return
        parsed = self.topics.parse_node(message.topic)
        if parsed is None:
            self._control(message)
            return
        addr, channel = parsed
        tracker = self.trackers.get(addr.row) if addr.site == self.site else None
        if tracker is None or tracker.rack_of(addr.node) != addr.rack:
            self._drop(message.topic, "topology", "node not in this aggregator's topology")
            return
        if not message.payload:
            return  # a retained message being cleared
        try:
            if channel == "telemetry":
                telemetry = decode(message.payload, Telemetry)
                assert isinstance(telemetry, Telemetry)  # noqa: S101 - decode checked it
                if telemetry.node != addr.node:
                    self._drop(message.topic, "topology", f"payload node {telemetry.node!r}")
                    return
                tracker.ingest_telemetry(addr.node, telemetry, now_s)
                if self.on_telemetry is not None:
                    self.on_telemetry(addr.row, addr.rack, addr.node, telemetry)
            elif channel == "status":
                status = decode(message.payload, Status)
                assert isinstance(status, Status)  # noqa: S101
                tracker.ingest_status(addr.node, status)
                if status.state == "offline":
                    _log.warning(
                        "node_offline",
                        row=addr.row,
                        rack=addr.rack,
                        node=addr.node,
                        reason=status.reason,
                    )
            elif channel == "events":
                event = decode(message.payload, Event)
                assert isinstance(event, Event)  # noqa: S101
                if self.on_event is not None:
                    self.on_event(addr.row, addr.rack, addr.node, event)
            else:
                decode(message.payload, State)  # validated, kept by the broker for status
        except SchemaError as exc:
            self._schema_drop(message.topic, exc)

    def _meter(self, message: InMessage, now_s: float) -> None:
        try:
            meter = decode(message.payload, Meter)
        except SchemaError as exc:
            self._schema_drop(message.topic, exc)
            return
        assert isinstance(meter, Meter)  # noqa: S101
        self.trackers[self._meters[message.topic]].ingest_meter(meter, now_s)

    def _cdu(self, message: InMessage, now_s: float) -> None:
        try:
            cdu = decode(message.payload, CduTelemetry)
        except SchemaError as exc:
            self._schema_drop(message.topic, exc)
            return
        assert isinstance(cdu, CduTelemetry)  # noqa: S101
        if cdu.cdu != self._cdu_topics[message.topic]:
            self._drop(message.topic, "topology", f"payload cdu {cdu.cdu!r}")
            return
        if self.on_cdu is not None:
            self.on_cdu(cdu, now_s)

    def _control(self, message: InMessage) -> None:
        if not message.payload:
            return
        try:
            control = decode(message.payload, Control)
        except SchemaError as exc:
            self._schema_drop(message.topic, exc)
            return
        assert isinstance(control, Control)  # noqa: S101
        if control.issuer != self.issuer:
            self._drop(message.topic, "foreign_control", f"issuer {control.issuer!r}")
            return
        if message.retain and self.on_retained_control is not None:
            self.on_retained_control(control)

    def _schema_drop(self, topic: str, exc: SchemaError) -> None:
        reason = "schema_version" if "schema_version" in str(exc) else "malformed"
        self._drop(topic, reason, str(exc))

    def _drop(self, topic: str, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        if (topic, reason) not in self._logged:
            self._logged.add((topic, reason))
            _log.warning(
                "message_dropped",
                topic=topic,
                reason=reason,
                detail=detail,
                dropped=self.dropped[reason],
            )
