"""``polca status``: the state of every row, rack and node, from retained MQTT messages.

Connects, subscribes to the retained summaries, control, node status and state of a site
(or all sites), waits a moment for the broker to deliver them, and prints tables. Reads
only: it never publishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from polca.settings import MqttSettings
from polca.telemetry.messages import InMessage
from polca.telemetry.oneshot import next_message, one_shot_bus
from polca.telemetry.schema import Control, RowSummary, SchemaError, State, Status, decode
from polca.telemetry.topics import Topics

MAX_ENTRIES = 200_000
"""Retained messages kept at most (every map here is keyed by strings from the broker)."""


@dataclass(slots=True)
class Snapshot:
    """What the retained messages say."""

    summaries: dict[tuple[str, str], RowSummary] = field(default_factory=dict)
    controls: dict[tuple[str, str, str | None], Control] = field(default_factory=dict)
    statuses: dict[tuple[str, str, str, str], Status] = field(default_factory=dict)
    states: dict[tuple[str, str, str, str], State] = field(default_factory=dict)
    aggregators: dict[tuple[str, str], Status] = field(default_factory=dict)
    rejected: int = 0  # malformed, naming another node than the topic, or beyond the bound

    def add(self, topics: Topics, message: InMessage) -> None:
        """File one retained message under its place."""
        if not message.payload:
            return
        known = (
            len(self.summaries)
            + len(self.controls)
            + len(self.statuses)
            + len(self.states)
            + len(self.aggregators)
        )
        if known >= MAX_ENTRIES:
            self.rejected += 1  # a broker holding more than any site has: keep what we have
            return
        try:
            payload = decode(message.payload)
        except SchemaError:
            self.rejected += 1
            return
        site = topics.site_of(message.topic) or ""
        parsed = topics.parse_node(message.topic)
        if parsed is not None:
            addr, _ = parsed
            if getattr(payload, "node", addr.node) != addr.node:
                self.rejected += 1  # a payload speaking for another node than its topic
                return
            key = (addr.site, addr.row, addr.rack, addr.node)
            if isinstance(payload, Status):
                self.statuses[key] = payload
            elif isinstance(payload, State):
                self.states[key] = payload
        elif isinstance(payload, RowSummary):
            self.summaries[(site, payload.row)] = payload
        elif isinstance(payload, Control):
            self.controls[(site, payload.row, payload.rack)] = payload
        elif isinstance(payload, Status) and (own := topics.parse_aggregator(message.topic)):
            self.aggregators[(own[0], own[1])] = payload


def _kw(watts: float | None) -> str:
    return "-" if watts is None else f"{watts / 1000:.1f} kW"


def render(snapshot: Snapshot, *, now_ns: int, out: TextIO) -> None:
    """Print the snapshot as tables."""
    if not (snapshot.summaries or snapshot.statuses or snapshot.controls):
        out.write("no polca state on this broker (no retained summaries, control or status)\n")
        return
    for (site, instance), status in sorted(snapshot.aggregators.items()):
        ha = ""
        if status.shard is not None:
            leader = status.leader or "none"
            ha = f", shard {status.shard}: {status.role}, leader {leader} term {status.term}"
        via = f", via {status.mqtt_endpoint}" if status.mqtt_endpoint else ""
        out.write(
            f"aggregator {site}/{instance}: {status.state}, policy "
            f"{status.policy_name} {status.policy_revision}{ha}{via}\n"
        )
    rows = sorted(
        {(s, r) for s, r in snapshot.summaries} | {(s, r) for s, r, _ in snapshot.controls}
    )
    if rows:
        out.write(
            f"\n{'ROW':<16}{'POWER':>11}{'BUDGET':>11}{'%':>7}  {'LEVEL':<10}{'LEASE':>8}  "
            f"{'SOURCE':<9}{'OFFLINE/STALE'}\n"
        )
    for site, row in rows:
        _render_row(snapshot, site, row, now_ns=now_ns, out=out)
    if snapshot.statuses:
        out.write(
            f"\n{'NODE':<32}{'STATUS':<9}{'LEVEL':>6}  {'MODE':<10}{'GPUS':>5}  "
            f"{'BROKER':<22}CAPS\n"
        )
    for key in sorted(snapshot.statuses):
        site, row, rack_name, node = key
        status = snapshot.statuses[key]
        state = snapshot.states.get(key)
        mode = "-"
        caps = "-"
        level = "-"
        if state is not None:
            level = str(state.level)
            mode = (
                "fail-safe" if state.fail_safe else ("observe" if state.observe_only else "enforce")
            )
            capped = [g for g in state.gpus if g.sm_clock_max_mhz or g.power_limit_w]
            caps = ", ".join(
                f"gpu{g.index}<={g.sm_clock_max_mhz}MHz"
                if g.sm_clock_max_mhz
                else f"gpu{g.index}<={g.power_limit_w:.0f}W"
                for g in capped[:4]
            ) + (f" +{len(capped) - 4}" if len(capped) > 4 else "")
            caps = caps or "uncapped"
        name = f"{site}/{row}/{rack_name}/{node}"
        broker = status.mqtt_endpoint or "-"
        out.write(
            f"{name:<32}{status.state:<9}{level:>6}  {mode:<10}{status.gpu_count:>5}  "
            f"{broker:<22}{caps}\n"
        )
    if snapshot.rejected:
        out.write(f"\n({snapshot.rejected} retained message(s) could not be read)\n")


def _render_row(snapshot: Snapshot, site: str, row: str, *, now_ns: int, out: TextIO) -> None:
    """One row of the table: its power, budget, level and lease, what it cannot take at its
    word, why it does not run on its meter alone, and its racks."""
    summary = snapshot.summaries.get((site, row))
    control = snapshot.controls.get((site, row, None))
    lease = "-"
    if control is not None:
        left_s = (control.lease_expires_ns - now_ns) / 1e9
        lease = f"{left_s:.1f}s" if left_s > 0 else "EXPIRED"
    level = control.level_name or str(control.level) if control else "-"
    if control is not None and control.observe:
        level += " (obs)"
    if summary is None:
        out.write(f"{site + '/' + row:<16}{'-':>11}{'-':>11}{'-':>7}  {level:<10}{lease:>8}\n")
        return
    pct = 100 * summary.power_w / summary.effective_budget_w
    gaps = (
        [f"{n} (offline)" for n in summary.offline_nodes]
        + [f"{n} (stale)" for n in summary.stale_nodes]
        + [f"{n} (implausible)" for n in summary.implausible_nodes]
    )
    out.write(
        f"{site + '/' + row:<16}{_kw(summary.power_w):>11}{_kw(summary.effective_budget_w):>11}"
        f"{pct:6.1f}%  {level:<10}{lease:>8}  {summary.power_source:<9}"
        f"{', '.join(gaps) or '-'}\n"
    )
    if summary.budget_origin != "config" or summary.leased_budget_w is not None:
        limit = f" ({summary.budget_limited_by})" if summary.budget_limited_by else ""
        leased = _kw(summary.leased_budget_w)
        out.write(
            f"  budget: {_kw(summary.electrical_budget_w or summary.budget_w).strip()} from "
            f"{summary.budget_origin}{limit}; configured {_kw(summary.budget_w).strip()}, "
            f"leased {leased.strip()}\n"
        )
    down = sorted(name for name, up in summary.feeds.items() if not up)
    if down:
        out.write(f"  feeds down: {', '.join(down)}\n")
    if summary.power_note:  # why the row does not run on its meter alone
        out.write(f"  power: {' '.join(summary.power_note.split())[:200]}\n")
    for rack in summary.racks:
        rack_control = snapshot.controls.get((site, row, rack.rack))
        rack_level = f" level {rack_control.level_name}" if rack_control else ""
        out.write(
            f"  rack {rack.rack:<10}{_kw(rack.power_w):>11}{_kw(rack.budget_w):>11}"
            f"  nodes {rack.nodes_online} up, {rack.nodes_stale} stale, "
            f"{rack.nodes_offline} offline{rack_level}\n"
        )


def as_json(snapshot: Snapshot, *, now_ns: int) -> dict[str, Any]:
    """The snapshot as plain data (``polca status --json``): every retained message read,
    decoded and validated, under its place; the same facts as the tables."""

    def dump(message: Status | Control | RowSummary | State) -> dict[str, Any]:
        return message.model_dump(mode="json")

    return {
        "collected_ns": now_ns,
        "aggregators": [
            {"site": site, "instance": instance, **dump(status)}
            for (site, instance), status in sorted(snapshot.aggregators.items())
        ],
        "rows": [
            {"site": site, "row": row, **dump(summary)}
            for (site, row), summary in sorted(snapshot.summaries.items())
        ],
        "controls": [
            {"site": site, "row": row, "rack": rack, **dump(control)}
            for (site, row, rack), control in sorted(
                snapshot.controls.items(),
                key=lambda item: (item[0][0], item[0][1], item[0][2] or ""),
            )
        ],
        "nodes": [
            {
                **dict(zip(("site", "row", "rack", "node"), key, strict=True)),
                "status": dump(status) if (status := snapshot.statuses.get(key)) else None,
                "state": dump(state) if (state := snapshot.states.get(key)) else None,
            }
            for key in sorted(set(snapshot.statuses) | set(snapshot.states))
        ],
        "rejected": snapshot.rejected,
    }


async def collect(
    settings: MqttSettings, *, root: str, site: str, wait_s: float, timeout_s: float = 5.0
) -> Snapshot:
    """Subscribe, gather retained messages for ``wait_s`` seconds, disconnect.

    Fails fast, once, without retrying: ``TransportAuthError`` when the broker refuses
    the credentials, ``TransportError`` when it cannot be reached or does not answer
    within ``timeout_s``, ``ConfigError`` for unusable TLS files.
    """
    topics = Topics(root)
    filters: Sequence[str] = (
        topics.row_summary(site, "+"),
        topics.row_control(site, "+"),
        topics.rack_control(site, "+", "+"),
        topics.all_nodes(site, "+", "status"),
        topics.all_nodes(site, "+", "state"),
        topics.aggregator(site, "+", "status"),
    )
    snapshot = Snapshot()
    async with one_shot_bus(
        settings,
        client_id="polca-status",
        subscriptions=[(f, 1) for f in filters],
        timeout_s=timeout_s,
    ) as bus:
        until = asyncio.get_running_loop().time() + wait_s
        while (message := await next_message(bus, until)) is not None:
            snapshot.add(topics, message)  # one at a time: the snapshot bounds what it keeps
    return snapshot
