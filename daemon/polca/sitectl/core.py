"""The site controller's core, without I/O: meters and row summaries in, leased budgets out.

``SiteCore`` keeps what the site controller knows, every map keyed by the names of the
site file (never by a network string):

- each feed's state (``powertree/capacity.py`` ``FeedState``) from the meters' readings
  (``Meter.states``: what each source's equipment says; ``Meter.missing``: the sources
  that did not answer), a UPS domain on battery when a source of its feeds says so;
- each row's demand (``powertree/allocate.py`` ``RowDemand``: its floor, its power per
  priority class) and power from its aggregator's retained summary, checked against the
  topic's row;
- the operators' limits on domains (``polca budget set``), each until its end.

A source of the site file is named ``GROUP/SOURCE`` (the meter group, the topic segment
its readings come on, and the source's name in them) or ``SOURCE`` alone (that name in any
group). ``step`` allocates each domain's live capacity to what it supplies (``allocate``)
and, while this instance may publish (alone, or leading: ``coord/leadership.py``), builds
one retained ``Budget`` per row: leased for ``lease_s``, numbered by ``(epoch_ns, seq)``
and stamped with the leadership term, so the rows' aggregators fence a deposed
controller out (``coord/fencing.py``).

What it must not do: read a clock (times come in), touch the bus, or raise out of
``receive`` for any message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import structlog

from polca.coord.leadership import Leadership
from polca.errors import SchemaError
from polca.powertree.allocate import Allocation, RowDemand, allocate
from polca.powertree.capacity import FeedState, SiteState, capacities_w, feed_up, fold_feeds
from polca.powertree.model import Feed, SiteTree
from polca.readings import EquipmentState
from polca.sitectl.config import SiteSettings
from polca.telemetry.checks import DropLog, check_identity
from polca.telemetry.messages import InMessage, OutMessage, topic_matches
from polca.telemetry.schema import (
    LOST_CONTACT_REASONS,
    Budget,
    BudgetLimit,
    BudgetOrigin,
    DomainReport,
    FeedReport,
    Meter,
    RowBudgetReport,
    RowSummary,
    SiteReport,
    decode,
    encode,
)
from polca.telemetry.topics import Topics

__all__ = ["DomainLimit", "RowSeen", "SiteCore", "SiteStep"]

_log = structlog.get_logger()
_REPORT_MAX = 512  # domains and rows in one report (the wire's bound)


@dataclass(frozen=True, slots=True)
class RowSeen:
    """A row as its aggregator's last summary showed it."""

    demand: RowDemand
    power_w: float
    received_s: float
    budget_origin: BudgetOrigin


@dataclass(frozen=True, slots=True)
class DomainLimit:
    """An operator's limit on a domain: its watts, until when (monotonic s), and why."""

    watts: float
    until_s: float | None
    reason: str
    by: str
    until_ns: int | None = None
    """The window's end as the operator gave it (Unix ns), for display."""


@dataclass(frozen=True, slots=True)
class SiteStep:
    """One allocation: the budgets, the state they came from, what to publish."""

    allocation: Allocation
    state: SiteState
    measured_w: Mapping[str, float]
    """Each row's and domain's power, from the rows' summaries."""
    stale_rows: tuple[str, ...]
    """Rows without a summary within ``summary_max_age_s`` (their last demand is used)."""
    unlimited_w: Mapping[str, float]
    """Each domain's capacity now without the operators' limits (what a limit may lower)."""
    feeds_up: Mapping[tuple[str, str], bool]
    """Each (domain, feed) of the tree: whether it counts as up now."""
    messages: list[OutMessage] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        tree: SiteTree,
        allocation: Allocation,
        state: SiteState,
        measured_w: Mapping[str, float],
        stale_rows: tuple[str, ...],
    ) -> SiteStep:
        """A step with what the report, the points and the logs read of it, derived once."""
        feeds_up = {
            (name, feed.name): feed_up(
                feed, state.feeds.get((name, feed.name)), dark_polls_down=state.dark_polls_down
            )
            for name, domain in tree.domains.items()
            for feed in domain.feeds
        }
        unlimited_w = capacities_w(tree, replace(state, limits_w={}))
        return cls(allocation, state, measured_w, stale_rows, unlimited_w, feeds_up)


@dataclass(slots=True)
class SiteCore:
    """What the site controller knows and decides; see the module docstring."""

    settings: SiteSettings
    tree: SiteTree
    epoch_ns: int
    leadership: Leadership = field(default_factory=Leadership)
    seq: int = 0
    feeds: dict[tuple[str, str], FeedState] = field(default_factory=dict)
    on_battery: dict[str, bool] = field(default_factory=dict)
    rows: dict[str, RowSeen] = field(default_factory=dict)
    limits: dict[str, DomainLimit] = field(default_factory=dict)
    received: Counter[str] = field(default_factory=Counter)
    """Messages taken, by kind."""
    drops: DropLog = field(init=False)
    topics: Topics = field(init=False)
    _sources: dict[str, list[tuple[str, Feed]]] = field(default_factory=dict)
    _battery: set[str] = field(default_factory=set)  # sources whose UPS is on battery
    _rows_under: dict[str, list[str]] = field(default_factory=dict)  # domain -> its rows
    _meter_filters: tuple[str, ...] = ()
    _summary_topics: dict[str, str] = field(default_factory=dict)  # topic -> row
    _limit_topics: dict[str, str] = field(default_factory=dict)  # topic -> domain
    _now_s: float = 0.0

    def __post_init__(self) -> None:
        """Index the site file's sources; nothing received yet."""
        self.topics = Topics(self.settings.topic_root)
        self.drops = DropLog("site_input_dropped", logger=_log, clock=lambda: self._now_s)
        for domain in self.tree.domains.values():
            for feed in domain.feeds:
                for source in feed.sources:
                    self._sources.setdefault(source, []).append((domain.name, feed))
        self._summary_topics = {
            self.topics.row_summary(self.settings.site, row): row for row in self.tree.rows
        }
        self._limit_topics = {
            self.topics.budget_limit(self.settings.site, name): name for name in self.tree.domains
        }
        for row in self.tree.rows:
            for name in self.tree.chain(row):
                self._rows_under.setdefault(name, []).append(row)
        default = self.topics.meter(self.settings.site, "+")
        self._meter_filters = (default, *self.settings.meter_topics)

    def subscriptions(self) -> list[tuple[str, int]]:
        """The meters' readings, the rows' retained summaries, the operators' limits."""
        summaries = [(topic, 1) for topic in self._summary_topics]
        limits = (self.topics.budget_limit(self.settings.site, "+"), 1)
        return [*((f, 0) for f in self._meter_filters), *summaries, limits]

    def receive(self, message: InMessage, now_s: float) -> bool:
        """Take one message received at ``now_s`` (monotonic); True when a feed changed.

        Never raises: a message that is not valid is counted by reason and dropped.
        """
        self._now_s = now_s
        try:
            return self._route(message, now_s)
        except SchemaError as exc:
            self.drops.drop(exc.reason, topic=message.topic, detail=str(exc))
        except Exception as exc:  # one message must never end the controller
            self.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))
        return False

    def _route(self, message: InMessage, now_s: float) -> bool:
        parts = message.topic.split("/")
        if not message.payload:
            return False  # a retained message being cleared
        domain = self._limit_topics.get(message.topic)
        if domain is not None:
            return self._limit(domain, message, now_s)
        row = self._summary_topics.get(message.topic)
        if row is not None:
            self._summary(row, decode(message.payload, RowSummary), now_s)
            return False
        if any(topic_matches(f, message.topic) for f in self._meter_filters):
            if message.retain:
                self.drops.drop("stale", topic=message.topic, detail="a retained meter reading")
                return False
            group = parts[-2] if len(parts) >= 2 else ""
            return self._meter(group, decode(message.payload, Meter))
        self.drops.drop("topology", topic=message.topic, detail="not a topic polca site reads")
        return False

    def _summary(self, row: str, summary: RowSummary, now_s: float) -> None:
        check_identity("row", payload=summary.row, topic=row)
        demand = RowDemand(
            floor_w=summary.floor_w or 0.0,
            demand_w=tuple(c.power_w for c in summary.power_by_class),
        )
        self.rows[row] = RowSeen(demand, summary.power_w, now_s, summary.budget_origin)
        self.received["summary"] += 1

    def _meter(self, group: str, meter: Meter) -> bool:
        self.received["meter"] += 1
        equipment: dict[str, EquipmentState] = {}
        dark: set[str] = set()
        for name, state in meter.states.items():
            for key in (name, f"{group}/{name}"):
                equipment[key] = state.equipment
                if key in self._sources:  # remembered for the site file's sources only
                    (self._battery.add if state.on_battery else self._battery.discard)(key)
        for name, why in meter.missing.items():
            if why in LOST_CONTACT_REASONS:
                dark.update((name, f"{group}/{name}"))
        touched = {
            (d, f.name): f for key in (*equipment, *dark) for d, f in self._sources.get(key, ())
        }
        changed = fold_feeds(
            touched,
            self.feeds,
            equipment=equipment,
            dark=dark,
            dark_polls_down=self.settings.dark_polls_down,
        )
        for domain in {d for d, _ in touched}:
            feeds = self.tree.domains[domain].feeds
            now = any(source in self._battery for f in feeds for source in f.sources)
            changed |= self.on_battery.get(domain, False) != now
            self.on_battery[domain] = now
        return changed

    def _limit(self, domain: str, message: InMessage, now_s: float) -> bool:
        """An operator's limit on ``domain``: set, or cleared; logged with who and why."""
        order = decode(message.payload, BudgetLimit)
        check_identity("domain", payload=order.domain, topic=domain)
        self.received["limit"] += 1
        if order.watts is None:
            self.set_limit(domain, None)
            _log.info("domain_limit_cleared", domain=domain, by=order.by, reason=order.reason)
            return True
        until_s = None
        if order.until_ns is not None:
            until_s = now_s + (order.until_ns - message.received_ns) / 1e9
            if until_s <= now_s:
                self.drops.drop("expired", topic=message.topic, detail="its window has ended")
                self.set_limit(domain, None)
                return True
        self.set_limit(
            domain, DomainLimit(order.watts, until_s, order.reason, order.by, order.until_ns)
        )
        _log.warning(
            "domain_limit_set",
            domain=domain,
            watts=order.watts,
            until_ns=order.until_ns,
            by=order.by,
            reason=order.reason,
        )
        return True

    def set_limit(self, domain: str, limit: DomainLimit | None) -> None:
        """An operator's limit on ``domain`` (None clears it); the caller checks the name."""
        if limit is None:
            self.limits.pop(domain, None)
        else:
            self.limits[domain] = limit

    def state(self, now_s: float) -> SiteState:
        """The feeds, the UPSes on battery and the operators' limits in force at ``now_s``."""
        for name, limit in list(self.limits.items()):
            if limit.until_s is not None and limit.until_s <= now_s:
                del self.limits[name]
                _log.info("domain_limit_ended", domain=name, watts=limit.watts, by=limit.by)
        return SiteState(
            feeds=dict(self.feeds),
            on_battery=frozenset(d for d, on in self.on_battery.items() if on),
            dark_polls_down=self.settings.dark_polls_down,
            limits_w={name: limit.watts for name, limit in self.limits.items()},
        )

    def step(self, now_s: float, *, now_ns: int, now_mono_ns: int) -> SiteStep:
        """Allocate the site's capacity now; the budgets to publish while this may publish."""
        self._now_s = now_s
        state = self.state(now_s)
        demands = {row: seen.demand for row, seen in self.rows.items()}
        allocation = allocate(self.tree, state, demands)
        measured: dict[str, float] = {row: seen.power_w for row, seen in self.rows.items()}
        for name, rows in self._rows_under.items():
            measured[name] = sum(measured.get(row, 0.0) for row in rows)
        max_age_s = self.settings.summary_max_age_s
        stale = tuple(
            row
            for row in self.tree.rows
            if row not in self.rows or now_s - self.rows[row].received_s > max_age_s
        )
        stepped = SiteStep.of(self.tree, allocation, state, measured, stale)
        if self.leadership.may_publish(now_mono_ns):
            self.seq += 1
            stepped.messages.extend(self._budget(row, allocation, now_ns) for row in self.tree.rows)
            report = self.report(stepped, now_ns=now_ns)
            topic = self.topics.site_report(self.settings.site)
            stepped.messages.append(OutMessage(topic, encode(report), qos=1, retain=True))
        return stepped

    def report(self, step: SiteStep, *, now_ns: int) -> SiteReport:
        """The tree as ``step`` saw it (``polca budget show``), cut to the wire's bounds."""
        allocation, state, measured = step.allocation, step.state, step.measured_w
        domains = []
        for name, domain in self.tree.domains.items():
            limit = self.limits.get(name)
            feeds = []
            for feed in domain.feeds:
                known = state.feeds.get((name, feed.name))
                feeds.append(
                    FeedReport(
                        name=feed.name,
                        rating_w=feed.rating_w,
                        up=step.feeds_up[(name, feed.name)],
                        equipment=known.equipment if known else "unknown",
                        dark_polls=known.dark_polls if known else 0,
                    )
                )
            domains.append(
                DomainReport(
                    name=name,
                    kind=domain.kind,
                    parent=self.tree.parent.get(name),
                    rating_w=domain.rating_w,
                    capacity_w=allocation.capacity_w[name],
                    unlimited_w=step.unlimited_w[name],
                    budget_w=allocation.budget_w[name],
                    nominal_w=allocation.nominal_w[name],
                    measured_w=measured.get(name, 0.0),
                    on_battery=name in state.on_battery,
                    feeds=tuple(feeds),
                    limit_w=limit.watts if limit else None,
                    limit_until_ns=limit.until_ns if limit else None,
                    limit_reason=limit.reason[:512] if limit else "",
                    limit_by=limit.by[:128] if limit else "",
                )
            )
        rows = [
            RowBudgetReport(
                name=row,
                parent=self.tree.parent.get(row),
                rating_w=leaf.rating_w,
                budget_w=allocation.budget_w[row],
                nominal_w=allocation.nominal_w[row],
                measured_w=seen.power_w if (seen := self.rows.get(row)) else None,
                limited_by=allocation.limited_by.get(row),
                origin=seen.budget_origin if seen else None,
                stale=row in step.stale_rows,
            )
            for row, leaf in self.tree.rows.items()
        ]
        cut = len(domains) > _REPORT_MAX or len(rows) > _REPORT_MAX
        return SiteReport(
            ts_ns=now_ns,
            issuer=self.settings.instance,
            term=self.leadership.term,
            publishing=True,
            domains=tuple(domains[:_REPORT_MAX]),
            rows=tuple(rows[:_REPORT_MAX]),
            truncated=cut,
        )

    def _budget(self, row: str, allocation: Allocation, now_ns: int) -> OutMessage:
        watts = allocation.budget_w[row]
        limited_by = allocation.limited_by.get(row)
        reason = (
            f"{limited_by}: capacity {allocation.capacity_w[limited_by]:.0f} W"
            if limited_by is not None
            else "the row's share of the design"
        )
        budget = Budget(
            ts_ns=now_ns,
            row=row,
            issuer=self.settings.instance,
            term=self.leadership.term,
            epoch_ns=self.epoch_ns,
            seq=self.seq,
            budget_w=watts,
            issued_ns=now_ns,
            lease_expires_ns=now_ns + round(self.settings.lease_s * 1e9),
            limited_by=limited_by,
            reason=reason,
        )
        topic = self.topics.budget(self.settings.site, row)
        return OutMessage(topic, encode(budget), qos=1, retain=True)
