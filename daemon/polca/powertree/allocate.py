"""Share each domain's capacity among what it supplies, by priority (pure; no clock).

Two passes over the tree, top-down:

1. **Nominal** (every feed up): each domain's capacity (``capacity.py`` with no feed
   down, its ``battery_w`` aside) is shared among its children: first each child's floor
   (what its nodes draw at the fail-safe caps; a domain's floor is its rows' sum), then
   the demand of each priority class in turn, highest first (a row's power held per class,
   summed up the tree), then what is left as headroom, each step in proportion and never
   above a child's own cap (its rating; a domain's nominal capacity too). When even the
   floors do not fit, the capacity is shared in proportion to them.
2. **Live** (the feeds as they are): each domain's budget is the least of its nominal
   share and its capacity now; a domain cut below its nominal share passes the cut down
   by keeping every child's floor first and shrinking the rest of each child's nominal
   share in proportion (a high-priority row, given more nominally, keeps more).

Why two passes: every live budget is then a non-increasing function of the feeds that are
down (the nominal shares do not see them, and each cut only takes away). So a feed's loss
never raises any budget, anywhere in the site, and the children of a domain are never
given more than it can carry now. The price: capacity a failed branch frees is not handed
to its siblings until the feed is back (the site runs on its design, never above it).

What it must not do: read meters, a clock or the bus; decide how a row enforces its budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from polca.powertree.capacity import SiteState, capacities_w
from polca.powertree.model import SiteTree

__all__ = ["Allocation", "RowDemand", "allocate"]

_EPS_W = 1e-6


@dataclass(frozen=True, slots=True)
class RowDemand:
    """What a row needs: its floor and its power held per priority class, highest first."""

    floor_w: float = 0.0
    demand_w: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        """Refuse negative or non-finite watts (a summary is checked before it gets here)."""
        for value in (self.floor_w, *self.demand_w):
            if not 0 <= value < float("inf"):
                msg = f"a row's floor and demand are finite, non-negative watts, not {value}"
                raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Each row's and domain's budget now, and what the design would give it."""

    budget_w: Mapping[str, float]
    """Live: what each row and domain may draw now."""
    nominal_w: Mapping[str, float]
    """With every feed up, for the same demand."""
    capacity_w: Mapping[str, float]
    """Each domain's capacity now."""
    limited_by: Mapping[str, str | None]
    """For each row, the highest domain above it whose cut lowered its budget below its
    nominal share (a feed down, a UPS on battery), else None."""


def allocate(tree: SiteTree, state: SiteState, demands: Mapping[str, RowDemand]) -> Allocation:
    """The site's budgets for ``demands`` (a row without one: no floor, no demand)."""
    nominal_cap = capacities_w(tree, SiteState(feeds={}))
    live_cap = capacities_w(tree, state)
    floor, demand = _sums(tree, demands)

    def cap_w(name: str) -> float:
        own = tree.rating_w(name)
        return min(own, nominal_cap[name]) if name in tree.domains else own

    nominal = {root: cap_w(root) for root in tree.roots}
    order = _top_down(tree)
    for name in order:
        children = tree.domains[name].supplies
        shares = _share(
            nominal[name],
            [floor[c] for c in children],
            [demand[c] for c in children],
            [cap_w(c) for c in children],
        )
        nominal.update(zip(children, shares, strict=True))

    budget: dict[str, float] = {}
    limited_by: dict[str, str | None] = {}
    cut_at: dict[str, str | None] = {}
    for root in tree.roots:
        budget[root] = min(nominal[root], live_cap[root])
        cut_at[root] = root if budget[root] < nominal[root] - _EPS_W else None
    for name in order:
        children = tree.domains[name].supplies
        kept = _shrink(budget[name], [nominal[c] for c in children], [floor[c] for c in children])
        for child, kept_w in zip(children, kept, strict=True):
            if child in tree.domains:
                budget[child] = min(kept_w, live_cap[child])
                own_cut = budget[child] < nominal[child] - _EPS_W
                cut_at[child] = cut_at[name] or (child if own_cut else None)
            else:
                budget[child] = kept_w
                limited_by[child] = cut_at[name] if kept_w < nominal[child] - _EPS_W else None
    return Allocation(budget, nominal, live_cap, limited_by)


def _top_down(tree: SiteTree) -> list[str]:
    """Every domain, each after the domain that supplies it."""
    out: list[str] = []
    stack = list(reversed(tree.roots))
    while stack:
        name = stack.pop()
        out.append(name)
        stack.extend(c for c in reversed(tree.domains[name].supplies) if c in tree.domains)
    return out


def _sums(
    tree: SiteTree, demands: Mapping[str, RowDemand]
) -> tuple[dict[str, float], dict[str, tuple[float, ...]]]:
    """Each row's and domain's floor and demand per class (a domain: its rows' sums)."""
    levels = max((len(d.demand_w) for d in demands.values()), default=0)
    floor: dict[str, float] = {}
    demand: dict[str, tuple[float, ...]] = {}
    for row in tree.rows:
        d = demands.get(row, RowDemand())
        floor[row] = d.floor_w
        demand[row] = tuple(d.demand_w) + (0.0,) * (levels - len(d.demand_w))
    for name in reversed(_top_down(tree)):
        children = tree.domains[name].supplies
        floor[name] = sum(floor[c] for c in children)
        demand[name] = tuple(sum(demand[c][k] for c in children) for k in range(levels))
    return floor, demand


def _share(
    avail_w: float,
    floors_w: Sequence[float],
    demands_w: Sequence[tuple[float, ...]],
    caps_w: Sequence[float],
) -> list[float]:
    """``avail_w`` shared: floors, then each class's demand, then headroom; never above a cap."""
    base = [min(f, c) for f, c in zip(floors_w, caps_w, strict=True)]
    total = sum(base)
    if total >= avail_w:
        return [avail_w * b / total if total > 0 else 0.0 for b in base]
    given = list(base)
    left = avail_w - total
    levels = max((len(d) for d in demands_w), default=0)
    for k in range(levels + 1):  # the last round is the headroom up to each cap
        wants = []
        for i, cap in enumerate(caps_w):
            wanted = sum(demands_w[i][: k + 1]) if k < levels else cap
            wants.append(max(0.0, min(cap, max(given[i], wanted)) - given[i]))
        asked = sum(wants)
        if asked <= 0:
            continue
        if asked <= left:
            given = [g + w for g, w in zip(given, wants, strict=True)]
            left -= asked
        else:
            given = [g + w * left / asked for g, w in zip(given, wants, strict=True)]
            break
    return given


def _shrink(budget_w: float, nominal_w: Sequence[float], floors_w: Sequence[float]) -> list[float]:
    """The children's live shares of a parent's ``budget_w``: their nominal shares when it
    allows them, else their floors kept first and the rest shrunk in proportion; each
    share rises with ``budget_w`` and never above its nominal."""
    total = sum(nominal_w)
    if budget_w >= total:
        return list(nominal_w)
    base = [min(f, n) for f, n in zip(floors_w, nominal_w, strict=True)]
    floor_total = sum(base)
    if budget_w <= floor_total:
        return [budget_w * b / floor_total if floor_total > 0 else 0.0 for b in base]
    spare = total - floor_total
    return [
        b + (budget_w - floor_total) * (n - b) / spare for b, n in zip(base, nominal_w, strict=True)
    ]
