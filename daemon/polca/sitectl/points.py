"""The points of the site controller, built from one allocation (pure).

The one place where a ``SiteStep`` (``core.py``) becomes points of
``polca.export.schema.SCHEMA``: one ``power_domain`` point per domain (its capacity now and
without the operators' limits, its budget and nominal share, the power its rows draw, its
rating and limit, a UPS on battery, its feeds up and down), one ``power_feed`` point per
feed (up or down, its rating, what its equipment says, how many polls its meter has been
dark) and one ``row_budget`` point per row (the budget leased to it, its nominal share,
its power, the domain whose cut limits it, a stale summary). The shell (``runtime.py``)
hands them to its sinks after each step.

Only the instance whose budgets count writes them: a standby writes none (as the
aggregator's standby writes none of the rows' series, ``Leadership.writes_row_series``),
so the series of a site come from one instance at a time.

What it must not do: I/O, read a clock (the time comes in) or decide anything the core
has not.
"""

from __future__ import annotations

from polca.coord.leadership import Leadership
from polca.export.points import Point, make_point
from polca.powertree.model import SiteTree
from polca.sitectl.core import SiteStep

__all__ = ["TREE_MEASUREMENTS", "step_points"]

TREE_MEASUREMENTS = frozenset({"power_domain", "power_feed", "row_budget"})
"""The measurements of these points: each step writes all of them, for the whole tree."""


def step_points(
    step: SiteStep, tree: SiteTree, *, site: str, ts_ns: int, leadership: Leadership
) -> list[Point]:
    """Every point of one allocation, stamped ``ts_ns``; none from a standby."""
    if not leadership.writes_row_series:
        return []
    out = _domain_points(step, tree, site=site, ts_ns=ts_ns)
    out.extend(_row_points(step, tree, site=site, ts_ns=ts_ns))
    return out


def _domain_points(step: SiteStep, tree: SiteTree, *, site: str, ts_ns: int) -> list[Point]:
    allocation, state = step.allocation, step.state
    out: list[Point] = []
    for name, domain in tree.domains.items():
        up = 0
        for feed in domain.feeds:
            known = state.feeds.get((name, feed.name))
            is_up = step.feeds_up[(name, feed.name)]
            up += 1 if is_up else 0
            out.append(
                make_point(
                    "power_feed",
                    ts_ns=ts_ns,
                    tags={"site": site, "domain": name, "feed": feed.name},
                    fields={
                        "up": 1.0 if is_up else 0.0,
                        "rating_w": feed.rating_w,
                        "dark_polls": known.dark_polls if known else 0,
                        "equipment": known.equipment if known else "unknown",
                    },
                )
            )
        out.append(
            make_point(
                "power_domain",
                ts_ns=ts_ns,
                tags={"site": site, "domain": name, "kind": domain.kind},
                fields={
                    "capacity_w": allocation.capacity_w[name],
                    "unlimited_w": step.unlimited_w[name],
                    "budget_w": allocation.budget_w[name],
                    "nominal_w": allocation.nominal_w[name],
                    "measured_w": step.measured_w.get(name, 0.0),
                    "rating_w": domain.rating_w,
                    "limit_w": state.limits_w.get(name),
                    "on_battery": 1.0 if name in state.on_battery else 0.0,
                    "feeds_up": up,
                    "feeds_down": len(domain.feeds) - up,
                },
            )
        )
    return out


def _row_points(step: SiteStep, tree: SiteTree, *, site: str, ts_ns: int) -> list[Point]:
    allocation = step.allocation
    out: list[Point] = []
    for row, leaf in tree.rows.items():
        limited_by = allocation.limited_by.get(row)
        out.append(
            make_point(
                "row_budget",
                ts_ns=ts_ns,
                tags={"site": site, "row": row},
                fields={
                    "budget_w": allocation.budget_w[row],
                    "nominal_w": allocation.nominal_w[row],
                    "measured_w": step.measured_w.get(row),
                    "rating_w": leaf.rating_w,
                    "limited": 0.0 if limited_by is None else 1.0,
                    "limited_by": limited_by,
                    "stale": 1.0 if row in step.stale_rows else 0.0,
                },
            )
        )
    return out
