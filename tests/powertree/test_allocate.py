"""Capacity and allocation: floors first, priority before headroom, and a feed's loss never
raises any budget or lets a domain be given more than it carries."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.powertree.allocate import Allocation, RowDemand, allocate
from polca.powertree.capacity import FeedState, SiteState, domain_capacity_w, feed_up
from polca.powertree.model import Feed, SiteTree, build_tree

ALL_UP = SiteState(feeds={})


def tree_of(data: dict[str, Any]) -> SiteTree:
    tree, problems = build_tree(data)
    assert problems == []
    assert tree is not None
    return tree


def flex_row(rating_w: float = 800_000) -> SiteTree:
    """One row on a 2N pair of feeds, each rated for half of what the row is budgeted."""
    return tree_of(
        {
            "rows": {"row1": {"rating_w": rating_w}},
            "domains": {
                "row1-power": {
                    "kind": "floor_pdu",
                    "rating_w": 800_000,
                    "feeds": [
                        {"name": "A", "rating_w": 400_000, "sources": ["pdu-a"]},
                        {"name": "B", "rating_w": 400_000, "sources": ["pdu-b"]},
                    ],
                    "supplies": ["row1"],
                }
            },
        }
    )


def shared_ups(ups_w: float = 600_000, battery_w: float = 300_000) -> SiteTree:
    return tree_of(
        {
            "rows": {"hi": {"rating_w": 400_000}, "lo": {"rating_w": 400_000}},
            "domains": {
                "ups": {
                    "kind": "ups",
                    "rating_w": ups_w,
                    "battery_w": battery_w,
                    "supplies": ["hi", "lo"],
                    "oversubscribed": True,
                }
            },
        }
    )


def down(*feeds: tuple[str, str], dark: int = 0) -> SiteState:
    return SiteState(feeds={f: FeedState("down" if not dark else "unknown", dark) for f in feeds})


def test_a_row_over_one_feed_drops_to_the_survivor_when_the_other_fails() -> None:
    tree = flex_row()
    demand = {"row1": RowDemand(floor_w=200_000, demand_w=(700_000,))}
    assert allocate(tree, ALL_UP, demand).budget_w["row1"] == 800_000
    after = allocate(tree, down(("row1-power", "B")), demand)
    assert after.budget_w["row1"] == 400_000
    assert after.limited_by["row1"] == "row1-power"
    assert after.capacity_w["row1-power"] == 400_000


def test_a_meter_powered_by_its_feed_going_dark_is_the_feed_down() -> None:
    feed = Feed("B", 400_000, ("pdu-b",), loss_means_down=True)
    assert feed_up(feed, FeedState("unknown", 2), dark_polls_down=3)
    assert not feed_up(feed, FeedState("unknown", 3), dark_polls_down=3)
    assert not feed_up(feed, FeedState("down", 0), dark_polls_down=3)
    independent = Feed("B", 400_000, ("pdu-b",), loss_means_down=False)
    assert feed_up(independent, FeedState("unknown", 99), dark_polls_down=3)
    tree = flex_row()
    dark = SiteState(feeds={("row1-power", "A"): FeedState("unknown", 5)}, dark_polls_down=3)
    assert domain_capacity_w(tree.domains["row1-power"], dark) == 400_000


def test_the_high_priority_row_keeps_more_of_a_short_ups() -> None:
    tree = shared_ups()
    demand = {
        "hi": RowDemand(floor_w=100_000, demand_w=(350_000, 0)),
        "lo": RowDemand(floor_w=100_000, demand_w=(0, 350_000)),
    }
    got = allocate(tree, ALL_UP, demand).budget_w
    assert got["hi"] == pytest.approx(350_000)  # its demand in full
    assert got["lo"] == pytest.approx(250_000)  # what is left of 600 kW
    assert got["hi"] + got["lo"] == pytest.approx(600_000)


def test_on_battery_the_ups_carries_its_battery_rating_floors_first() -> None:
    tree = shared_ups()
    demand = {
        "hi": RowDemand(floor_w=100_000, demand_w=(350_000, 0)),
        "lo": RowDemand(floor_w=100_000, demand_w=(0, 350_000)),
    }
    got = allocate(tree, SiteState(feeds={}, on_battery=frozenset({"ups"})), demand)
    assert got.capacity_w["ups"] == 300_000
    assert got.budget_w["hi"] + got.budget_w["lo"] == pytest.approx(300_000)
    assert got.budget_w["hi"] > got.budget_w["lo"] >= 100_000
    assert got.limited_by == {"hi": "ups", "lo": "ups"}


def test_when_even_the_floors_do_not_fit_they_share_in_proportion() -> None:
    tree = shared_ups(ups_w=150_000)
    demand = {"hi": RowDemand(floor_w=200_000), "lo": RowDemand(floor_w=100_000)}
    got = allocate(tree, ALL_UP, demand).budget_w
    assert got["hi"] == pytest.approx(100_000)
    assert got["lo"] == pytest.approx(50_000)


def test_headroom_is_shared_up_to_each_rating() -> None:
    got = allocate(shared_ups(ups_w=1_000_000), ALL_UP, {}).budget_w
    assert got == {"ups": 1_000_000, "hi": 400_000, "lo": 400_000}


def test_a_negative_or_infinite_demand_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        RowDemand(floor_w=-1)
    with pytest.raises(ValueError, match="non-negative"):
        RowDemand(demand_w=(float("inf"),))
    with pytest.raises(ValueError, match="non-negative"):
        RowDemand(demand_w=(float("nan"),))


# -- properties over random sites -----------------------------------------------------------


@st.composite
def sites(draw: st.DrawFn) -> tuple[SiteTree, dict[str, RowDemand]]:
    """A random tree two or three levels deep with feeds, and a demand for each row."""
    watts = st.integers(min_value=1, max_value=2_000_000)
    rows: dict[str, Any] = {}
    domains: dict[str, Any] = {}
    demands: dict[str, RowDemand] = {}
    top = [f"t{i}" for i in range(draw(st.integers(1, 2)))]
    for t in top:
        mids = [f"{t}m{j}" for j in range(draw(st.integers(1, 3)))]
        domains[t] = {"rating_w": draw(watts), "supplies": mids, "oversubscribed": True}
        for m in mids:
            leaves = [f"{m}r{k}" for k in range(draw(st.integers(1, 3)))]
            rating = draw(watts)
            feeds = [
                {"name": f"f{n}", "rating_w": draw(st.integers(1, rating))}
                for n in range(draw(st.integers(0, 3)))
            ]
            domains[m] = {
                "rating_w": rating,
                "supplies": leaves,
                "feeds": feeds,
                "battery_w": draw(watts),
                "oversubscribed": True,
            }
            for r in leaves:
                rows[r] = {"rating_w": draw(watts)}
                floor = draw(st.integers(0, 500_000))
                classes = draw(st.lists(st.integers(0, 800_000), min_size=0, max_size=3))
                demands[r] = RowDemand(floor_w=floor, demand_w=tuple(map(float, classes)))
    return tree_of({"rows": rows, "domains": domains}), demands


def _feeds(tree: SiteTree) -> list[tuple[str, str]]:
    return [(d.name, f.name) for d in tree.domains.values() for f in d.feeds]


def _check_within(tree: SiteTree, got: Allocation) -> None:
    for name, domain in tree.domains.items():
        given_w = sum(got.budget_w[c] for c in domain.supplies)
        assert given_w <= got.capacity_w[name] * (1 + 1e-9) + 1e-6, name
        assert given_w <= got.budget_w[name] * (1 + 1e-9) + 1e-6, name
        assert got.budget_w[name] <= got.capacity_w[name] + 1e-6
    for row, leaf in tree.rows.items():
        assert 0 <= got.budget_w[row] <= leaf.rating_w + 1e-6


@settings(max_examples=200, deadline=None)
@given(sites(), st.data())
def test_no_domain_is_ever_given_more_than_it_carries(
    site: tuple[SiteTree, dict[str, RowDemand]], data: st.DataObject
) -> None:
    tree, demands = site
    feeds = _feeds(tree)
    lost = data.draw(st.lists(st.sampled_from(feeds), unique=True) if feeds else st.just([]))
    battery = data.draw(st.sets(st.sampled_from(sorted(tree.domains))))
    state = SiteState(feeds={f: FeedState("down") for f in lost}, on_battery=frozenset(battery))
    _check_within(tree, allocate(tree, state, demands))


@settings(max_examples=200, deadline=None)
@given(sites(), st.data())
def test_a_feeds_loss_never_raises_any_budget(
    site: tuple[SiteTree, dict[str, RowDemand]], data: st.DataObject
) -> None:
    tree, demands = site
    feeds = _feeds(tree)
    if not feeds:
        return
    order = data.draw(st.permutations(feeds))
    state: dict[tuple[str, str], FeedState] = {}
    before = allocate(tree, SiteState(feeds={}), demands)
    for feed in order:
        state[feed] = FeedState("down")
        after = allocate(tree, SiteState(feeds=dict(state)), demands)
        for name, budget_w in after.budget_w.items():
            assert budget_w <= before.budget_w[name] * (1 + 1e-9) + 1e-6, (feed, name)
        before = after


@settings(max_examples=100, deadline=None)
@given(sites())
def test_with_every_feed_up_each_row_gets_its_floor_when_the_floors_fit(
    site: tuple[SiteTree, dict[str, RowDemand]],
) -> None:
    tree, demands = site
    got = allocate(tree, SiteState(feeds={}), demands)
    for name, domain in tree.domains.items():
        floors = [
            min(demands[c].floor_w, tree.rating_w(c)) if c in tree.rows else None
            for c in domain.supplies
        ]
        if None in floors or sum(f for f in floors if f is not None) > got.budget_w[name]:
            continue
        for child, floor in zip(domain.supplies, floors, strict=True):
            assert got.budget_w[child] >= (floor or 0) * (1 - 1e-9) - 1e-6, child
