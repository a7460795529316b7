"""The site file's tree: built when sound, every problem named with its path when not."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.powertree.model import MAX_NAMES, Feed, SiteTree, build_tree


def site(**domains: Any) -> dict[str, Any]:
    return {
        "rows": {"row1": {"rating_w": 400_000}, "row2": {"rating_w": 400_000}},
        "domains": domains
        or {
            "utility": {"kind": "utility", "rating_w": 2_000_000, "supplies": ["ups-a"]},
            "ups-a": {
                "kind": "ups",
                "rating_w": 1_000_000,
                "battery_w": 500_000,
                "feeds": [
                    {"name": "A", "rating_w": 600_000, "sources": ["pdu-a1"]},
                    {"name": "B", "rating_w": 600_000, "loss_means_down": False},
                ],
                "supplies": ["row1", "row2"],
            },
        },
    }


def built(data: object) -> SiteTree:
    tree, problems = build_tree(data)
    assert problems == []
    assert tree is not None
    return tree


def problems_of(data: object) -> list[tuple[str, str]]:
    tree, problems = build_tree(data)
    assert tree is None
    assert problems
    return [(p.where(), p.message) for p in problems]


def test_a_sound_site_is_a_tree_with_parents_and_feeds() -> None:
    tree = built(site())
    assert tree.roots == ("utility",)
    assert tree.chain("row2") == ("ups-a", "utility")
    ups = tree.domains["ups-a"]
    assert ups.kind == "ups"
    assert ups.battery_w == 500_000
    assert ups.feeds == (
        Feed("A", 600_000.0, ("pdu-a1",), True),
        Feed("B", 600_000.0, (), False),
    )
    assert tree.rating_w("row1") == 400_000


def test_a_cycle_is_named() -> None:
    found = problems_of(
        {
            "rows": {"row1": {"rating_w": 1}},
            "domains": {
                "a": {"rating_w": 10, "supplies": ["b", "row1"]},
                "b": {"rating_w": 10, "supplies": ["a"]},
            },
        }
    )
    assert ("domains.a", "'a' is in a cycle") in found


def test_a_row_supplied_by_nothing_or_by_two_domains_is_refused() -> None:
    data = site(
        x={"rating_w": 1_000_000, "supplies": ["row1"]},
        y={"rating_w": 1_000_000, "supplies": ["row1"]},
    )
    found = problems_of(data)
    assert ("domains.y.supplies[0]", "'row1' is already supplied by 'x'") in found
    assert ("rows.row2", "row 'row2' is supplied by no domain") in found


def test_a_child_rated_above_its_parent_needs_oversubscribed() -> None:
    small = {"rating_w": 500_000, "supplies": ["row1", "row2"]}
    assert problems_of(site(pdu={**small, "rating_w": 300_000})) == [
        (
            "domains.pdu.supplies[0]",
            "'row1' is rated 400000 W, above 'pdu''s 300000 W (say oversubscribed: true if meant)",
        ),
        (
            "domains.pdu.supplies[1]",
            "'row2' is rated 400000 W, above 'pdu''s 300000 W (say oversubscribed: true if meant)",
        ),
    ]
    built(site(pdu={**small, "rating_w": 300_000, "oversubscribed": True}))
    built(site(pdu=small))  # the sum of the rows above the parent is oversubscription too,
    # and allowed: the allocation shares the parent (a 2N pair is rated this way)


@pytest.mark.parametrize(
    ("domain", "where", "message"),
    [
        ({"rating_w": 0, "supplies": ["row1", "row2"]}, "domains.d.rating_w", "above 0 W"),
        ({"rating_w": "1 MW", "supplies": ["row1", "row2"]}, "domains.d.rating_w", "number"),
        ({"rating_w": True, "supplies": ["row1", "row2"]}, "domains.d.rating_w", "number"),
        ({"rating_w": 1e6, "supplies": []}, "domains.d.supplies", "at least one"),
        (
            {"rating_w": 1e6, "supplies": ["row1", "row2"], "colour": 1},
            "domains.d.colour",
            "unknown",
        ),
        (
            {"rating_w": 1e6, "supplies": ["row1", "row2"], "kind": "ups2"},
            "domains.d.kind",
            "one of",
        ),
        ({"rating_w": 1e6, "supplies": ["row1", "row9"]}, "domains.d.supplies[1]", "neither"),
        ({"rating_w": 1e6, "supplies": ["row1", "row1"]}, "domains.d.supplies[1]", "twice"),
        ({"rating_w": 1e6, "supplies": ["row1", "r/2"]}, "domains.d.supplies[1]", "A-Za-z"),
        (
            {
                "rating_w": 1e6,
                "supplies": ["row1", "row2"],
                "feeds": [{"name": "A", "rating_w": 2e6}],
            },
            "domains.d.feeds[0].rating_w",
            "above its domain",
        ),
        (
            {
                "rating_w": 1e6,
                "supplies": ["row1", "row2"],
                "feeds": [{"name": "A", "rating_w": 1}, {"name": "A", "rating_w": 1}],
            },
            "domains.d.feeds[1].name",
            "twice",
        ),
        (
            {"rating_w": 1e6, "supplies": ["row1", "row2"], "feeds": [{"rating_w": 1}]},
            "domains.d.feeds[0].name",
            "name",
        ),
        (
            {"rating_w": 1e6, "supplies": ["row1", "row2"], "feeds": "A"},
            "domains.d.feeds",
            "list",
        ),
    ],
)
def test_each_bad_value_is_named_by_its_path(domain: Any, where: str, message: str) -> None:
    found = problems_of(site(d=domain))
    assert any(w == where and message in m for w, m in found), found


def test_every_problem_is_listed_at_once() -> None:
    found = problems_of(
        site(
            d={"rating_w": 0, "supplies": ["row1", "row2"], "x": 1},
            e={"rating_w": -1, "supplies": ["nowhere"]},
        )
    )
    wheres = {w for w, _ in found}
    assert {"domains.d.x", "domains.e.rating_w", "domains.e.supplies[0]"} <= wheres


def test_a_site_without_rows_or_not_a_mapping_is_refused() -> None:
    assert problems_of([]) == [("", "a site file is a mapping with rows and domains")]
    assert ("rows", "a site has at least one row") in problems_of({"domains": {}})


def test_a_file_of_too_many_names_is_refused_before_its_entries_are_read() -> None:
    rows = {f"r{i}": {"rating_w": 1} for i in range(MAX_NAMES + 1)}
    assert ("rows", f"more than {MAX_NAMES} entries") in problems_of({"rows": rows})


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["rows", "domains", "rating_w", "supplies", "feeds", "name", "row1", "d"]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@given(_VALUES)
def test_any_data_is_a_tree_or_problems_never_an_exception(data: object) -> None:
    tree, problems = build_tree(data)
    assert (tree is None) == bool(problems)
    for problem in problems:
        assert isinstance(problem.where(), str)
        assert problem.message


def test_names_that_collide_with_polca_topics_are_refused() -> None:
    tree, problems = build_tree(
        {
            "rows": {"powertree": {"rating_w": 1}, "row1": {"rating_w": 1}},
            "domains": {
                "control": {"kind": "ups", "rating_w": 10, "supplies": ["row1"]},
            },
        }
    )
    assert tree is None
    where = {p.where(): p.message for p in problems}
    assert "reserved" in where["rows.powertree"]
    assert "reserved" in where["domains.control"]
