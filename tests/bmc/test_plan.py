"""When a node is capped through its BMC, and when it is let go (pure)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from polca.bmc.plan import NodeState, OobPlanner, agent_cannot

BASE = NodeState(
    node="n1",
    health="fresh",
    fail_safe=False,
    level=0,
    top_level=3,
    fail_safe_w=3000.0,
    brake_w=2000.0,
)


def test_a_fresh_agent_is_never_capped_out_of_band_whatever_the_level() -> None:
    planner = OobPlanner()
    for level in range(4):
        assert planner.plan([replace(BASE, level=level)], float(level)) == []
    assert planner.capped == {}


def test_a_dead_agent_is_capped_only_when_its_scope_caps() -> None:
    planner = OobPlanner(cap_from_level=1)
    dead = replace(BASE, health="offline")
    assert planner.plan([dead], 0.0) == []  # level 0: nothing to cap
    [target] = planner.plan([replace(dead, level=2)], 1.0)
    assert target.watts == 3000.0
    assert "offline at level 2" in target.reason
    assert planner.plan([replace(dead, level=2)], 2.0) == []  # held, not written again
    assert planner.capped == {"n1": 3000.0}


def test_stale_unknown_and_fail_safe_agents_count_as_unable() -> None:
    assert agent_cannot(replace(BASE, health="stale"))
    assert agent_cannot(replace(BASE, health="unknown"))
    assert agent_cannot(replace(BASE, fail_safe=True))
    assert not agent_cannot(BASE)
    planner = OobPlanner()
    [target] = planner.plan([replace(BASE, fail_safe=True, level=1)], 0.0)
    assert "in fail-safe" in target.reason


def test_the_brake_reaches_a_node_whose_agent_does_not_answer() -> None:
    planner = OobPlanner()
    dead = replace(BASE, health="stale", level=1)
    assert planner.plan([dead], 0.0)[0].watts == 3000.0
    [brake] = planner.plan([replace(dead, level=3)], 1.0)
    assert brake.watts == 2000.0
    assert "(brake)" in brake.reason
    [back_down] = planner.plan([replace(dead, level=2)], 2.0)
    assert back_down.watts == 3000.0


def test_release_needs_the_agent_back_for_a_while_and_the_scope_released() -> None:
    planner = OobPlanner(agent_back_s=5.0)
    planner.plan([replace(BASE, health="offline", level=2)], 0.0)
    # The agent is back but the row is still hot: the out-of-band cap stays.
    assert planner.plan([replace(BASE, level=2)], 1.0) == []
    assert planner.plan([replace(BASE, level=0)], 3.0) == []  # back for 2 s only
    # It drops out again: the clock of its return starts over.
    assert planner.plan([replace(BASE, health="stale", level=0)], 4.0) == []
    assert planner.plan([replace(BASE, level=0)], 5.0) == []
    assert planner.plan([replace(BASE, level=0)], 9.0) == []
    [release] = planner.plan([replace(BASE, level=0)], 10.0)
    assert release.watts is None
    assert planner.capped == {}


def test_a_dead_agent_in_a_released_row_stays_capped() -> None:
    planner = OobPlanner(agent_back_s=0.0)
    planner.plan([replace(BASE, health="offline", level=1)], 0.0)
    assert planner.plan([replace(BASE, health="offline", level=0)], 100.0) == []
    assert planner.capped == {"n1": 3000.0}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["fresh", "stale", "offline", "unknown"]),
            st.booleans(),
            st.integers(0, 3),
        ),
        max_size=60,
    )
)
def test_never_an_uncap_while_the_agent_cannot_or_the_scope_caps(
    steps: list[tuple[str, bool, int]],
) -> None:
    planner = OobPlanner(agent_back_s=0.0)
    for t, (health, fail_safe, level) in enumerate(steps):
        state = replace(BASE, health=health, fail_safe=fail_safe, level=level)  # type: ignore[arg-type]
        for target in planner.plan([state], float(t)):
            if target.watts is None:
                assert not agent_cannot(state)
                assert level == 0
            else:
                assert agent_cannot(state)
                assert level >= 1
        if agent_cannot(state) and level >= 1:
            assert "n1" in planner.capped
