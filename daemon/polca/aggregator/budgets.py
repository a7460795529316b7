"""Which budget each row runs on: its own, the site controller's lease, or its feeds' (pure).

A row's electrical budget is the least of:

- its configured ``budget_w`` (origin ``config``): nothing from outside ever raises a row
  above it;
- for a row that takes site budgets (``fallback_budget_w`` set), the site controller's
  leased ``Budget`` while its lease is valid (origin ``lease``, ``limited_by`` the domain
  whose capacity set it) and, when none is (it lapsed, none came yet), the
  ``fallback_budget_w`` (origin ``fallback``);
- for a row whose ``feeds`` are listed, the ratings of the feeds that are up now (origin
  ``feeds``, ``limited_by`` the feeds down): the fast path of a feed's failure, taken on
  the row meter's next reading without waiting for the site controller.

Budget messages are ordered, fenced and leased by ``coord/fencing.py`` ``LeaseFence``
(the agent's rules for control), after two checks of their own: ``foreign`` (a row this
aggregator does not own, or one that takes no site budgets) and ``issuer`` (not one of
``site_budget.issuers``). A budget above the row's configured budget is taken but cannot
raise it. Every refusal is counted by verdict.

A feed's state comes from the row meter's readings (``Meter.states``: what each source's
equipment says; ``Meter.missing``: the sources that did not answer), folded by
``powertree/capacity.py`` ``fold_feeds`` and judged by ``feed_up``.

What it must not do: read a clock (times come in) or the bus.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from polca.aggregator.config import RowSpec, SiteBudgetSettings
from polca.aggregator.rollup import NodeHealth, NodeView
from polca.coord.fencing import FenceVerdict, LeaseFence, Stamp
from polca.policy import Policy
from polca.powertree.capacity import FeedState, feed_up, fold_feeds
from polca.telemetry.checks import ClockWindow
from polca.telemetry.schema import LOST_CONTACT_REASONS, Budget, BudgetOrigin, Meter

__all__ = [
    "BudgetInForce",
    "BudgetVerdict",
    "RowDemandView",
    "SiteBudgets",
    "row_demand",
]

BudgetVerdict = FenceVerdict | Literal["foreign", "issuer"]


@dataclass(frozen=True, slots=True)
class BudgetInForce:
    """A row's electrical budget now and where it comes from."""

    budget_w: float
    origin: BudgetOrigin
    limited_by: str | None = None
    """The domain that set a leased budget, or the feeds down (``feed B``)."""
    leased_w: float | None = None
    """The site controller's budget while its lease is valid."""
    lease_expires_mono_ns: int | None = None
    feeds: tuple[tuple[str, bool], ...] = ()
    """Each listed feed of the row and whether it is up."""


@dataclass(frozen=True, slots=True)
class _Lease:
    budget: Budget
    expires_mono_ns: int


@dataclass(slots=True)
class SiteBudgets:
    """The leased budgets and the feeds of the rows one aggregator owns."""

    rows: Mapping[str, RowSpec]
    settings: SiteBudgetSettings
    window: ClockWindow
    refused: Counter[str] = field(default_factory=Counter)
    """Budget messages refused, by verdict."""
    moved: bool = False
    """Whether the last budget offered changed its row's leased budget (``offer``)."""
    _fence: LeaseFence = field(init=False)
    _leases: dict[str, _Lease] = field(default_factory=dict)  # owned rows only
    _feeds: dict[str, dict[str, FeedState]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """One fence for the site controller's terms, keyed by row."""
        self._fence = LeaseFence(self.window)

    def takes_budgets(self, row: str) -> bool:
        """Whether ``row`` is one of ours that runs on the site controller's budgets."""
        spec = self.rows.get(row)
        return spec is not None and spec.fallback_budget_w is not None

    def offer(
        self,
        budget: Budget,
        *,
        received_mono_ns: int,
        received_wall_ns: int,
        retained: bool,
    ) -> BudgetVerdict:
        """Consider one budget message received at these times (monotonic and Unix ns).

        ``moved`` says afterwards whether it changed the row's leased budget (a new value,
        another limiting domain, or a lease where there was none): a renewal of the same
        budget, every second, needs no control step of its own.
        """
        self.moved = False
        verdict = self._judge(
            budget,
            received_mono_ns=received_mono_ns,
            received_wall_ns=received_wall_ns,
            retained=retained,
        )
        if verdict != "granted":
            self.refused[verdict] += 1
        return verdict

    def _judge(
        self,
        budget: Budget,
        *,
        received_mono_ns: int,
        received_wall_ns: int,
        retained: bool,
    ) -> BudgetVerdict:
        if not self.takes_budgets(budget.row):
            return "foreign"
        if self.settings.issuers and budget.issuer not in self.settings.issuers:
            return "issuer"
        stamp = Stamp(
            budget.term, budget.epoch_ns, budget.seq, budget.issued_ns, budget.lease_expires_ns
        )
        verdict, granted_ns = self._fence.judge(
            budget.row,
            stamp,
            received_mono_ns=received_mono_ns,
            received_wall_ns=received_wall_ns,
            retained=retained,
            max_lease_ns=round(self.settings.max_lease_s * 1e9),
        )
        if verdict == "granted":
            expires = received_mono_ns + granted_ns
            self._fence.accept(budget.row, stamp, expires_mono_ns=expires)
            before = self._leases.get(budget.row)
            self.moved = (
                before is None
                or before.expires_mono_ns <= received_mono_ns
                or (before.budget.budget_w, before.budget.limited_by)
                != (budget.budget_w, budget.limited_by)
            )
            self._leases[budget.row] = _Lease(budget, expires)
        return verdict

    def note_meter(self, row: str, meter: Meter) -> bool:
        """Fold one meter reading of ``row`` into its feeds; True when one went up or down."""
        spec = self.rows.get(row)
        if spec is None or not spec.feeds:
            return False
        return fold_feeds(
            {f.name: f.feed() for f in spec.feeds},
            self._feeds.setdefault(row, {}),
            equipment={name: state.equipment for name, state in meter.states.items()},
            dark=frozenset(n for n, why in meter.missing.items() if why in LOST_CONTACT_REASONS),
            dark_polls_down=self.settings.dark_polls_down,
        )

    def feeds(self, row: str) -> dict[str, bool]:
        """Each listed feed of ``row``: whether it is up."""
        spec = self.rows[row]
        states = self._feeds.get(row, {})
        down = self.settings.dark_polls_down
        return {
            f.name: feed_up(f.feed(), states.get(f.name), dark_polls_down=down) for f in spec.feeds
        }

    def in_force(self, row: str, now_mono_ns: int) -> BudgetInForce:
        """The budget ``row`` runs on at ``now_mono_ns``: the least of its candidates."""
        spec = self.rows[row]
        best = BudgetInForce(spec.budget_w, "config")
        leased_w: float | None = None
        expires: int | None = None
        if spec.fallback_budget_w is not None:
            lease = self._leases.get(row)
            if lease is not None and lease.expires_mono_ns > now_mono_ns:
                leased_w, expires = lease.budget.budget_w, lease.expires_mono_ns
                if leased_w < best.budget_w:
                    best = BudgetInForce(leased_w, "lease", lease.budget.limited_by)
            elif spec.fallback_budget_w < best.budget_w:
                best = BudgetInForce(spec.fallback_budget_w, "fallback")
        feeds = self.feeds(row)
        if feeds:
            up_w = sum(f.rating_w for f in spec.feeds if feeds[f.name])
            if up_w < best.budget_w:
                down = [name for name, up in feeds.items() if not up]
                best = BudgetInForce(up_w, "feeds", "feed " + ", ".join(down) if down else None)
        return replace(
            best, leased_w=leased_w, lease_expires_mono_ns=expires, feeds=tuple(feeds.items())
        )


@dataclass(frozen=True, slots=True)
class RowDemandView:
    """What a row tells the site controller it needs: its floor and its power per class."""

    floor_w: float
    """What its nodes draw at the fail-safe caps (``floor_w`` configured, else estimated)."""
    power_by_class_w: tuple[tuple[str, float], ...]
    """GPU power held per priority class, the policy's most important class first."""


def row_demand(
    spec: RowSpec, nodes: Iterable[tuple[NodeView, NodeHealth]], policy: Policy
) -> RowDemandView:
    """A row's floor and its power per class from its nodes as this step counted them.

    A fresh node's GPUs are counted per class at their mean power, and at the least of it
    and their class's fail-safe power limit for the floor (a class whose fail-safe caps
    only lock clocks is counted at its power now); a node that is not fresh is counted at
    its conservative power, in the floor and in the default class, as the rollup counts it.
    """
    by_class: dict[str, float] = dict.fromkeys(policy.classes, 0.0)
    floor_w = 0.0
    caps = policy.fail_safe.caps
    for view, health in nodes:
        telemetry = view.telemetry
        if health != "fresh" or telemetry is None:
            counted = view.power_w(health)
            floor_w += counted
            by_class[policy.default_class] = by_class.get(policy.default_class, 0.0) + counted
            continue
        gpu_floor_w = 0.0
        for gpu in telemetry.gpus:
            power_w = gpu.power_mean_w if gpu.power_mean_w is not None else gpu.power_w or 0.0
            cls = gpu.priority_class or policy.static_class(index=gpu.index, uuid=gpu.uuid)
            if cls in by_class:
                by_class[cls] += power_w
            else:
                by_class[policy.default_class] += power_w
            cap = caps.get(cls)
            limit_w = None
            if cap is not None and cap.power_limit_w is not None:
                limit_w = cap.power_limit_w
            elif cap is not None and cap.power_limit_pct is not None:
                maximum = gpu.power_limit_max_w
                limit_w = cap.power_limit_pct * maximum / 100 if maximum is not None else None
            gpu_floor_w += power_w if limit_w is None else min(power_w, limit_w)
        floor_w += max(0.0, view.power_w(health) - view.gpu_power_w + gpu_floor_w)
    if spec.floor_w is not None:
        floor_w = spec.floor_w
    ordered = tuple((cls, by_class[cls]) for cls in policy.classes)
    return RowDemandView(floor_w, ordered)
