"""The only place MQTT topic strings are built and parsed.

Layout (the version segment is part of ``root``, default ``polca/v1``)::

    {root}/{site}/{row}/{rack}/{node}/telemetry   agent -> aggregator, QoS 0
    {root}/{site}/{row}/{rack}/{node}/status      retained, QoS 1, also the Last Will
    {root}/{site}/{row}/{rack}/{node}/state       retained, QoS 1: caps in force and why
    {root}/{site}/{row}/{rack}/{node}/events      QoS 1
    {root}/{site}/{row}/{rack}/{node}/assign      retained: priority classes from a scheduler
    {root}/{site}/{row}/control                   retained, QoS 1: row-scope control
    {root}/{site}/{row}/{rack}/control            retained, QoS 1: rack-scope control
    {root}/{site}/{row}/policy                    retained, QoS 1: the node policy bundle
    {root}/{site}/{row}/meter                     a PDU/meter's row power (configurable)
    {root}/{site}/{row}/summary                   retained: the row as the aggregator sees it
    {root}/{site}/{row}/budget                    retained, leased: a row's budget (polca site)
    {root}/{site}/powertree/state                 retained: the power tree (polca site)
    {root}/{site}/powertree/limit/{domain}        retained: an operator's limit on a domain
    {root}/{site}/aggregator/{instance}/status    retained, with a Last Will
    {root}/{site}/aggregator/{instance}/events    QoS 1: control decisions (audit), drops
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from polca.settings import DEFAULT_TOPIC_ROOT, TOPIC_SEGMENT

NodeChannel = Literal["telemetry", "status", "state", "events", "assign"]
NODE_CHANNELS: tuple[NodeChannel, ...] = ("telemetry", "status", "state", "events", "assign")

_SEGMENT = re.compile(TOPIC_SEGMENT)
RESERVED_ROW_NAMES = frozenset({"cooling", "aggregator", "powertree"})
"""Levels under a site that polca's own topics use: no row may be named so."""
RESERVED_DOMAIN_NAMES = frozenset({"control"})
"""A power domain named so would have a limit topic (``{site}/powertree/limit/control``)
shaped like a rack's control, which the broker's pattern ACL cannot tell apart."""


def _check_segment(kind: str, value: str) -> str:
    if not _SEGMENT.fullmatch(value):
        msg = f"invalid {kind} topic segment {value!r}: use letters, digits, '_', '.', '-'"
        raise ValueError(msg)
    return value


_PARSED: dict[tuple[str, str], tuple[NodeAddress, NodeChannel] | None] = {}
_PARSED_MAX = 16_384
_MISS = object()


@dataclass(frozen=True, slots=True)
class NodeAddress:
    """Where one node sits: site, row (power domain), rack, node."""

    site: str
    row: str
    rack: str
    node: str

    def __post_init__(self) -> None:
        for kind in ("site", "row", "rack", "node"):
            _check_segment(kind, getattr(self, kind))


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic builder and parser for one topic root."""

    root: str = DEFAULT_TOPIC_ROOT

    def node(self, addr: NodeAddress, channel: NodeChannel) -> str:
        """The topic of one of a node's channels."""
        return f"{self.root}/{addr.site}/{addr.row}/{addr.rack}/{addr.node}/{channel}"

    def row_control(self, site: str, row: str) -> str:
        """Row-scope control topic."""
        return f"{self.root}/{site}/{row}/control"

    def rack_control(self, site: str, row: str, rack: str) -> str:
        """Rack-scope control topic."""
        return f"{self.root}/{site}/{row}/{rack}/control"

    def policy(self, site: str, row: str) -> str:
        """The retained node policy of a row."""
        return f"{self.root}/{site}/{row}/policy"

    def meter(self, site: str, row: str) -> str:
        """The default topic of a row's power meter."""
        return f"{self.root}/{site}/{row}/meter"

    def budget(self, site: str, row: str) -> str:
        """The retained, leased budget of a row, from the site controller."""
        return f"{self.root}/{site}/{row}/budget"

    def site_report(self, site: str) -> str:
        """The site controller's retained report of the power tree."""
        return f"{self.root}/{site}/powertree/state"

    def budget_limit(self, site: str, domain: str) -> str:
        """An operator's retained limit on a domain of the power tree."""
        return f"{self.root}/{site}/powertree/limit/{domain}"

    def row_summary(self, site: str, row: str) -> str:
        """The retained row summary published by the aggregator."""
        return f"{self.root}/{site}/{row}/summary"

    def cdu(self, site: str, cdu: str) -> str:
        """A CDU's telemetry topic."""
        return f"{self.root}/{site}/cooling/{cdu}/telemetry"

    def loop_state(self, site: str, loop: str) -> str:
        """A cooling loop's retained state, published by the aggregator."""
        return f"{self.root}/{site}/cooling/loop/{loop}/state"

    def loop_alarms(self, site: str, loop: str) -> str:
        """A cooling loop's alarm events (raise and clear), QoS 1."""
        return f"{self.root}/{site}/cooling/loop/{loop}/alarms"

    def aggregator(self, site: str, instance: str, channel: str) -> str:
        """An aggregator's own status or events topic."""
        return f"{self.root}/{site}/aggregator/{instance}/{channel}"

    def all_nodes(self, site: str = "+", row: str = "+", channel: str = "+") -> str:
        """A subscription filter over node channels."""
        return f"{self.root}/{site}/{row}/+/+/{channel}"

    def node_anywhere(self, site: str, node: str, channel: NodeChannel) -> str:
        """A subscription filter over one node's ``channel`` in any row and rack (its place
        unknown: ``polca assign`` reads it from the node's status)."""
        return f"{self.root}/{site}/+/+/{_check_segment('node', node)}/{channel}"

    def _segments(self, topic: str) -> list[str] | None:
        """The segments of ``topic`` below this root; None for another root."""
        prefix = self.root + "/"
        return topic[len(prefix) :].split("/") if topic.startswith(prefix) else None

    def site_of(self, topic: str) -> str | None:
        """The site segment of a topic under this root (None for another root)."""
        parts = self._segments(topic)
        if parts is None or not parts[0]:
            return None
        return parts[0]

    def parse_aggregator(self, topic: str) -> tuple[str, str, str] | None:
        """``(site, instance, channel)`` of an aggregator's own topic; None if not one."""
        parts = self._segments(topic)
        if parts is None or len(parts) != 4 or parts[1] != "aggregator":
            return None
        return parts[0], parts[2], parts[3]

    def parse_node(self, topic: str) -> tuple[NodeAddress, NodeChannel] | None:
        """Split a node topic into its address and channel; None if it is not one.

        Results are cached (the same few thousand topics arrive every second), in a map
        bounded at ``_PARSED_MAX`` entries that is emptied when full: topics come from the
        network, and a publisher inventing new ones must not grow memory.
        """
        cache = _PARSED
        hit = cache.get((self.root, topic), _MISS)
        if hit is not _MISS:
            return hit  # type: ignore[return-value]
        parsed = self._parse_node(topic)
        if len(cache) >= _PARSED_MAX:
            cache.clear()
        cache[(self.root, topic)] = parsed
        return parsed

    def _parse_node(self, topic: str) -> tuple[NodeAddress, NodeChannel] | None:
        parts = self._segments(topic)
        if parts is None or len(parts) != 5 or parts[4] not in NODE_CHANNELS:
            return None
        try:
            addr = NodeAddress(*parts[:4])
        except ValueError:
            return None
        channel: NodeChannel = parts[4]
        return addr, channel
