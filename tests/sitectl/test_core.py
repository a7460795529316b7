"""The site controller's core without a shell: meters and summaries in, budgets out.

Times are passed in; the tree is the example's shape (two rows on a UPS fed by A and B).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from polca.coord.leadership import Leadership
from polca.powertree.model import SiteTree, build_tree
from polca.sitectl.config import SiteSettings
from polca.sitectl.core import DomainLimit, SiteCore
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import (
    Budget,
    BudgetLimit,
    ClassPower,
    Meter,
    RowSummary,
    SiteReport,
    SourceState,
    decode,
    encode,
)
from tests.fuzzing import FUZZ

S = 1_000_000_000
WALL = 1_700_000_000 * S
ROOT = "polca/v1/dc1"


def _tree() -> SiteTree:
    tree, problems = build_tree(
        {
            "rows": {"row1": {"rating_w": 400_000}, "row2": {"rating_w": 400_000}},
            "domains": {
                "ups-a": {
                    "kind": "ups",
                    "rating_w": 600_000,
                    "battery_w": 300_000,
                    "feeds": [
                        {"name": "A", "rating_w": 600_000, "sources": ["meters/ups-a-in"]},
                        {"name": "B", "rating_w": 600_000, "sources": ["pdu-b"]},
                    ],
                    "supplies": ["row1", "row2"],
                    "oversubscribed": True,
                }
            },
        }
    )
    assert tree is not None, problems
    return tree


def _core(**over: Any) -> SiteCore:
    settings = SiteSettings(site="dc1", instance="site-a", lease_s=30.0, **over)
    return SiteCore(settings, _tree(), epoch_ns=WALL)


def _msg(topic: str, payload: bytes, *, retain: bool = False) -> InMessage:
    return InMessage(f"{ROOT}/{topic}", payload, retain, WALL, 0)


def _meter(states: dict[str, SourceState], missing: dict[str, str] | None = None) -> bytes:
    return encode(
        Meter(ts_ns=WALL, power_w=1.0, states=states, missing=missing or {}, partial=bool(missing))
    )


def _summary(row: str, *, high_w: float, low_w: float, floor_w: float = 50_000.0) -> bytes:
    return encode(
        RowSummary(
            ts_ns=WALL,
            row=row,
            issuer="agg",
            power_w=high_w + low_w + 20_000,
            power_source="computed",
            budget_w=400_000,
            effective_budget_w=400_000,
            level=0,
            floor_w=floor_w,
            power_by_class=(
                ClassPower(priority_class="high", power_w=high_w),
                ClassPower(priority_class="low", power_w=low_w),
            ),
        )
    )


def _budgets(core: SiteCore, now_s: float = 1.0) -> dict[str, Budget]:
    step = core.step(now_s, now_ns=WALL, now_mono_ns=round(now_s * S))
    out = {}
    for message in step.messages:
        if message.topic == f"{ROOT}/powertree/state":
            continue
        budget = decode(message.payload, Budget)
        assert message.topic == f"{ROOT}/{budget.row}/budget"
        assert message.retain
        assert message.qos == 1
        out[budget.row] = budget
    return out


def test_the_high_priority_row_keeps_more_of_a_ups_below_both_budgets() -> None:
    core = _core()
    core.receive(_msg("row1/summary", _summary("row1", high_w=300_000, low_w=50_000)), 1.0)
    core.receive(_msg("row2/summary", _summary("row2", high_w=20_000, low_w=330_000)), 1.0)
    budgets = _budgets(core)
    assert budgets["row1"].budget_w + budgets["row2"].budget_w <= 600_000 + 1e-6
    assert budgets["row1"].budget_w >= 300_000  # its high-priority demand is all kept
    assert budgets["row1"].budget_w > budgets["row2"].budget_w
    assert budgets["row2"].budget_w >= 50_000  # never below its floor
    assert {b.issuer for b in budgets.values()} == {"site-a"}
    assert all(b.lease_expires_ns - b.issued_ns == 30 * S for b in budgets.values())


def test_a_feed_whose_breaker_trips_changes_nothing_while_the_other_carries_the_ups() -> None:
    core = _core()
    before = _budgets(core)
    up = SourceState(equipment="up")
    core.receive(_msg("meters/meter", _meter({"ups-a-in": up})), 1.0)
    down = SourceState(equipment="down")
    assert core.receive(_msg("row1/meter", _meter({"pdu-b": down})), 1.5)  # a change: step
    after = _budgets(core, 2.0)
    assert after["row1"].budget_w == before["row1"].budget_w  # A alone carries 600 kW
    # Now A's meter (named by its group) goes dark for the configured polls: nothing left.
    dark = _meter({}, {"ups-a-in": "unreachable"})
    wakes = [core.receive(_msg("meters/meter", dark), 2.0 + i) for i in range(3)]
    assert wakes == [False, False, True]
    cut = _budgets(core, 6.0)
    assert cut["row1"].budget_w == 0.0
    assert cut["row1"].limited_by == "ups-a"
    # A source of the same name in another group is not A's meter.
    assert not core.receive(_msg("row2/meter", _meter({"ups-a-in": up})), 7.0)
    assert _budgets(core, 7.0)["row1"].budget_w == 0.0


def test_a_ups_on_battery_is_held_to_its_battery_rating_until_its_input_returns() -> None:
    core = _core()
    battery = SourceState(equipment="up", on_battery=True, battery_minutes=12)
    assert core.receive(_msg("meters/meter", _meter({"ups-a-in": battery})), 1.0)
    budgets = _budgets(core)
    assert sum(b.budget_w for b in budgets.values()) <= 300_000 + 1e-6
    assert core.receive(
        _msg("meters/meter", _meter({"ups-a-in": SourceState(equipment="up")})), 2.0
    )
    assert sum(b.budget_w for b in _budgets(core, 2.0).values()) == 600_000


def test_a_maintenance_limit_lowers_the_domain_for_its_window_only() -> None:
    core = _core()
    core.set_limit("ups-a", DomainLimit(200_000, until_s=10.0, reason="UPS service", by="ops"))
    assert sum(b.budget_w for b in _budgets(core, 5.0).values()) <= 200_000 + 1e-6
    assert sum(b.budget_w for b in _budgets(core, 10.0).values()) == 600_000
    assert "ups-a" not in core.limits
    core.set_limit("ups-a", DomainLimit(100_000, until_s=None, reason="hold", by="ops"))
    assert sum(b.budget_w for b in _budgets(core, 11.0).values()) <= 100_000 + 1e-6
    core.set_limit("ups-a", None)
    assert sum(b.budget_w for b in _budgets(core, 12.0).values()) == 600_000


def test_hostile_inputs_are_counted_and_change_nothing() -> None:
    core = _core()
    before = _budgets(core)
    forged = _summary("row2", high_w=390_000, low_w=0)  # row2's summary on row1's topic
    assert not core.receive(_msg("row1/summary", forged), 1.0)
    assert not core.receive(_msg("row1/meter", b"\xff{"), 1.0)
    stale = _meter({"pdu-b": SourceState(equipment="down")})
    assert not core.receive(_msg("row1/meter", stale, retain=True), 1.0)
    assert not core.receive(_msg("row9/summary", _summary("row9", high_w=1, low_w=1)), 1.0)
    assert not core.receive(InMessage("elsewhere/x", b"{}", False, WALL, 0), 1.0)
    assert core.rows == {}
    assert core.feeds == {}
    assert set(core.drops.counts) >= {"identity", "stale", "topology"}
    assert sum(core.drops.counts.values()) == 5
    assert _budgets(core) == {
        row: b.model_copy(update={"seq": b.seq + 1}) for row, b in before.items()
    }


def test_a_standby_publishes_nothing_and_a_leader_stamps_its_term() -> None:
    core = _core()
    core.leadership = Leadership.standby()
    assert core.step(1.0, now_ns=WALL, now_mono_ns=S).messages == []
    core.leadership.elected(term=42, instance="site-a", sent_mono_ns=S, ttl_s=2.0)
    budgets = _budgets(core, 1.5)
    assert {b.term for b in budgets.values()} == {42}
    # Past the leader's deadline (its etcd lease not renewed) it stops publishing.
    assert core.step(4.0, now_ns=WALL, now_mono_ns=4 * S).messages == []


def _limit(domain: str, watts: float | None, *, until_ns: int | None = None) -> bytes:
    return encode(
        BudgetLimit(
            ts_ns=WALL,
            domain=domain,
            watts=watts,
            until_ns=until_ns,
            reason="UPS-A service",
            by="ops@host",
        )
    )


def test_an_operators_limit_over_the_wire_is_set_shown_and_cleared() -> None:
    core = _core()
    assert core.receive(_msg("powertree/limit/ups-a", _limit("ups-a", 250_000)), 1.0)
    step = core.step(2.0, now_ns=WALL, now_mono_ns=2 * S)
    (report,) = [decode(m.payload, SiteReport) for m in step.messages if m.topic.endswith("/state")]
    (ups,) = report.domains
    assert (ups.capacity_w, ups.unlimited_w, ups.limit_w) == (250_000, 600_000, 250_000)
    assert (ups.limit_by, ups.limit_reason) == ("ops@host", "UPS-A service")
    assert [f.up for f in ups.feeds] == [True, True]
    assert sum(r.budget_w for r in report.rows) <= 250_000 + 1e-6
    assert core.receive(_msg("powertree/limit/ups-a", _limit("ups-a", None)), 3.0)
    assert sum(b.budget_w for b in _budgets(core, 3.0).values()) == 600_000


def test_a_limit_window_ends_on_this_clock_and_a_forged_one_changes_nothing() -> None:
    core = _core()
    until_ns = WALL + 10 * S  # ten seconds after receipt (the message's wall stamp)
    assert core.receive(
        _msg("powertree/limit/ups-a", _limit("ups-a", 100_000, until_ns=until_ns)), 1.0
    )
    assert sum(b.budget_w for b in _budgets(core, 10.9).values()) <= 100_000 + 1e-6
    assert sum(b.budget_w for b in _budgets(core, 11.1).values()) == 600_000
    # On another domain's topic, for a domain not in the tree, already over: dropped.
    assert not core.receive(_msg("powertree/limit/ups-a", _limit("ups-b", 1.0)), 12.0)
    assert not core.receive(_msg("powertree/limit/ups-b", _limit("ups-b", 1.0)), 12.0)
    past = _limit("ups-a", 1.0, until_ns=WALL - S)
    core.receive(_msg("powertree/limit/ups-a", past), 12.0)
    assert core.limits == {}
    assert sum(b.budget_w for b in _budgets(core, 12.0).values()) == 600_000


_TOPICS = st.sampled_from(
    [
        "row1/summary",
        "row9/summary",
        "row1/meter",
        "meters/meter",
        "powertree/limit/ups-a",
        "powertree/limit/ups-z",
        "powertree/state",
        "row1/budget",
    ]
)
_STATE = st.fixed_dictionaries(
    {"equipment": st.sampled_from(["up", "down", "unknown", "off", 3])},
    optional={"on_battery": st.one_of(st.booleans(), st.integers())},
)
_PAYLOADS = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda states, missing: json.dumps(
            {
                "schema_version": 1,
                "kind": "meter",
                "ts_ns": WALL,
                "power_w": 1.0,
                "states": states,
                "missing": missing,
            }
        ).encode(),
        st.dictionaries(
            st.sampled_from(["ups-a-in", "pdu-b", "x" * 200, "ok"]), _STATE, max_size=3
        ),
        st.dictionaries(st.sampled_from(["ups-a-in", "pdu-b"]), st.sampled_from(["timeout", "x"])),
    ),
    st.builds(
        lambda domain, watts, until: json.dumps(
            {
                "schema_version": 1,
                "kind": "budget_limit",
                "ts_ns": WALL,
                "domain": domain,
                "watts": watts,
                "until_ns": until,
                "reason": "r",
                "by": "b",
            }
        ).encode(),
        st.sampled_from(["ups-a", "ups-z", ""]),
        st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-5, 10**13)),
        st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    ),
)


@FUZZ
@given(st.lists(st.tuples(_TOPICS, _PAYLOADS, st.booleans()), max_size=20))
def test_any_message_on_any_topic_is_taken_or_counted_and_never_grows_the_state(
    messages: list[tuple[str, bytes, bool]],
) -> None:
    core = _core()
    for i, (topic, payload, retain) in enumerate(messages):
        core.receive(_msg(topic, payload, retain=retain), float(i))
    assert set(core.rows) <= {"row1", "row2"}
    assert set(core.limits) <= {"ups-a"}
    assert set(core.feeds) <= {("ups-a", "A"), ("ups-a", "B")}
    assert set(core.on_battery) <= {"ups-a"}
    step = core.step(float(len(messages)), now_ns=WALL, now_mono_ns=S)
    for name, watts in step.allocation.budget_w.items():
        assert 0.0 <= watts <= core.tree.rating_w(name) + 1e-6
