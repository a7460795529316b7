"""The budget a row runs on: its own, the site controller's lease, its fallback, its feeds.

Driven through the aggregator's core (a received message in, a step out, times passed in)
and, for the rules alone, ``SiteBudgets`` with hypothesis: nothing from outside ever takes
a row above its configured budget, and a feed's loss never raises it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
from hypothesis import given
from hypothesis import strategies as st

from polca.aggregator.budgets import SiteBudgets
from polca.aggregator.config import AggregatorSettings, RowSpec, SiteBudgetSettings
from polca.aggregator.core import AggregatorCore
from polca.aggregator.step import RowResult
from polca.policy import PolicyStore
from polca.telemetry.checks import ClockWindow
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import (
    Budget,
    GpuTelemetry,
    Meter,
    RowSummary,
    SourceState,
    Telemetry,
    decode,
    encode,
)
from tests.fuzzing import FUZZ

POLICY = Path(__file__).resolve().parents[2] / "policies" / "polca-a100.yaml"
BASE = "polca/v1/dc1/row1"
S = 1_000_000_000
WALL = 1_700_000_000 * S


def _row(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": "row1",
        "budget_w": 10_000.0,
        "fallback_budget_w": 6_000.0,
        "feeds": [
            {"name": "A", "rating_w": 6_000.0, "sources": ["pdu-a"]},
            {"name": "B", "rating_w": 6_000.0, "sources": ["pdu-b"]},
        ],
        "racks": [{"name": "r1", "nodes": [{"name": "n1"}, {"name": "n2"}]}],
    }
    row.update(over)
    return row


def _core(tmp_path: Path, **row: Any) -> AggregatorCore:
    settings = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[_row(**row)],
        control={"warmup_s": 0.0, "stale_after_s": 5.0, "lease_s": 10.0},
        site_budget={"issuers": ["site-a", "site-b"], "max_lease_s": 30.0},
    )
    store = PolicyStore(POLICY)
    store.reload()
    core = AggregatorCore(settings, policy_store=store, epoch_ns=1, log=structlog.get_logger())
    core.rows.start(0.0)
    return core


def _budget(
    watts: float,
    *,
    seq: int = 1,
    term: int = 5,
    issuer: str = "site-a",
    row: str = "row1",
    lease_s: float = 20.0,
    issued_ns: int = WALL,
) -> bytes:
    return encode(
        Budget(
            ts_ns=issued_ns,
            row=row,
            issuer=issuer,
            term=term,
            epoch_ns=WALL - S,
            seq=seq,
            budget_w=watts,
            issued_ns=issued_ns,
            lease_expires_ns=issued_ns + round(lease_s * S),
            limited_by="ups-a",
        )
    )


def _meter(
    *, states: dict[str, str], missing: dict[str, str] | None = None, power_w: float = 5_000.0
) -> bytes:
    return encode(
        Meter(
            ts_ns=WALL,
            power_w=power_w,
            sources=len(states),
            partial=bool(missing),
            missing=missing or {},
            states={name: SourceState(equipment=eq) for name, eq in states.items()},
        )
    )


def _telemetry(node: str) -> bytes:
    return encode(
        Telemetry(
            ts_ns=WALL,
            seq=1,
            node=node,
            interval_s=1,
            node_gpu_power_w=800.0,
            node_energy_delta_j=1,
            gpus=tuple(
                GpuTelemetry(index=i, uuid=f"GPU-{node}-{i}", name="A100", power_mean_w=200.0)
                for i in range(4)
            ),
        )
    )


def _send(
    core: AggregatorCore, topic: str, payload: bytes, *, now_s: float, retain: bool = False
) -> bool:
    message = InMessage(f"{BASE}/{topic}", payload, retain, WALL, round(now_s * S))
    return core.receive(message, received_s=now_s, now_s=now_s, writing=False).wake


def _step(core: AggregatorCore, now_s: float) -> RowResult:
    for node in ("n1", "n2"):
        _send(core, f"r1/{node}/telemetry", _telemetry(node), now_s=now_s)
    stepped = core.step(now_s, now_ns=WALL, now_mono_ns=round(now_s * S))
    assert stepped is not None
    return stepped.result.rows[0]


def _summary(core: AggregatorCore, now_s: float) -> RowSummary:
    _step(core, now_s)
    stepped = core.step(now_s, now_ns=WALL, now_mono_ns=round(now_s * S))
    assert stepped is not None
    (summary,) = [m for m in stepped.messages if m.topic == f"{BASE}/summary"]
    return decode(summary.payload, RowSummary)


def test_a_row_that_takes_site_budgets_runs_on_its_fallback_until_a_lease_comes(
    tmp_path: Path,
) -> None:
    core = _core(tmp_path)
    row = _step(core, 1.0)
    assert (row.electrical.budget_w, row.electrical.origin) == (6_000.0, "fallback")
    assert _send(core, "budget", _budget(8_000.0), now_s=1.5)  # taken: step now
    row = _step(core, 2.0)
    assert (row.electrical.budget_w, row.electrical.origin) == (8_000.0, "lease")
    assert row.electrical.limited_by == "ups-a"
    assert row.budgets.row_w == 8_000.0
    # The site controller renews the same budget every step: no control step of its own.
    assert not _send(core, "budget", _budget(8_000.0, seq=2), now_s=2.5)
    assert _send(core, "budget", _budget(7_000.0, seq=3), now_s=3.0)  # a new value: step now
    # The lease runs out 20 s after receipt, on this clock: back to the fallback.
    assert _step(core, 22.9).electrical.budget_w == 7_000.0
    row = _step(core, 23.1)
    assert (row.electrical.budget_w, row.electrical.origin) == (6_000.0, "fallback")


def test_a_lease_can_only_lower_a_row_below_its_configuration(tmp_path: Path) -> None:
    core = _core(tmp_path)
    assert _send(core, "budget", _budget(50_000.0), now_s=1.0)
    row = _step(core, 2.0)
    assert (row.electrical.budget_w, row.electrical.origin) == (10_000.0, "config")
    assert row.electrical.leased_w == 50_000.0


def test_a_row_without_a_fallback_takes_no_budget(tmp_path: Path) -> None:
    core = _core(tmp_path, fallback_budget_w=None, feeds=[])
    assert f"{BASE}/budget" not in [t for t, _ in core.intake.subscriptions()]
    assert not _send(core, "budget", _budget(1_000.0), now_s=1.0)
    row = _step(core, 2.0)
    assert (row.electrical.budget_w, row.electrical.origin) == (10_000.0, "config")


def test_forged_or_stale_budgets_change_nothing_and_are_counted(tmp_path: Path) -> None:
    core = _core(tmp_path)
    assert _send(core, "budget", _budget(8_000.0, seq=10, term=5), now_s=1.0)
    hostile = {
        "issuer": _budget(2_000.0, seq=11, issuer="mallory"),
        "fenced": _budget(2_000.0, seq=11, term=4),
        "stale": _budget(2_000.0, seq=9),
        "term_jump": _budget(2_000.0, seq=11, term=2**41),
        "expired": _budget(2_000.0, seq=12, lease_s=-1.0),
    }
    for verdict, payload in hostile.items():
        assert not _send(core, "budget", payload, now_s=1.5), verdict
        assert core.rows.budgets.refused[verdict] == 1, verdict
    assert not _send(core, "budget", _budget(2_000.0, row="row2"), now_s=1.5)  # identity
    assert core.intake.dropped["identity"] == 1
    assert not _send(core, "budget", b"{not json", now_s=1.5)
    row = _step(core, 2.0)
    assert (row.electrical.budget_w, row.electrical.origin) == (8_000.0, "lease")


def test_a_retained_budget_older_than_its_lease_grants_nothing(tmp_path: Path) -> None:
    core = _core(tmp_path)
    old = _budget(8_000.0, issued_ns=WALL - 25 * S)
    assert not _send(core, "budget", old, now_s=1.0, retain=True)
    assert core.rows.budgets.refused["expired"] == 1
    fresh = _budget(7_000.0, seq=2, issued_ns=WALL - 5 * S)  # 15 s of its 20 s left
    assert _send(core, "budget", fresh, now_s=1.0, retain=True)
    assert _step(core, 15.9).electrical.origin == "lease"
    assert _step(core, 16.1).electrical.origin == "fallback"


def test_a_feed_whose_breaker_trips_cuts_the_row_to_the_survivor_at_once(
    tmp_path: Path,
) -> None:
    core = _core(tmp_path, fallback_budget_w=None)
    _send(core, "meter", _meter(states={"pdu-a": "up", "pdu-b": "up"}), now_s=1.0)
    assert _step(core, 1.0).electrical.budget_w == 10_000.0
    assert _send(core, "meter", _meter(states={"pdu-a": "up", "pdu-b": "down"}), now_s=2.0)
    row = _step(core, 2.0)
    assert (row.electrical.budget_w, row.electrical.origin) == (6_000.0, "feeds")
    assert row.electrical.limited_by == "feed B"
    assert dict(row.electrical.feeds) == {"A": True, "B": False}
    assert _send(core, "meter", _meter(states={"pdu-a": "up", "pdu-b": "up"}), now_s=3.0)
    assert _step(core, 3.0).electrical.origin == "config"


def test_a_feed_whose_meter_goes_dark_is_down_after_the_configured_polls(
    tmp_path: Path,
) -> None:
    core = _core(tmp_path, fallback_budget_w=None)
    dark = _meter(states={"pdu-a": "up"}, missing={"pdu-b": "timeout"})
    wakes = [_send(core, "meter", dark, now_s=float(t)) for t in (1, 2, 3)]
    assert wakes == [False, False, True]  # down at the third poll without an answer
    assert _step(core, 3.0).electrical.budget_w == 6_000.0
    # A source that answers wrongly (a config error) is not dark: the feed stays up.
    core = _core(tmp_path, fallback_budget_w=None)
    wrong = _meter(states={"pdu-a": "up"}, missing={"pdu-b": "config"})
    for t in (1, 2, 3, 4):
        _send(core, "meter", wrong, now_s=float(t))
    assert _step(core, 4.0).electrical.budget_w == 10_000.0


def test_the_summary_says_the_origin_the_feeds_the_floor_and_the_classes(
    tmp_path: Path,
) -> None:
    core = _core(tmp_path)
    _send(core, "budget", _budget(7_500.0), now_s=1.0)
    _send(core, "meter", _meter(states={"pdu-a": "up", "pdu-b": "down"}), now_s=1.0)
    summary = _summary(core, 2.0)
    assert summary.budget_w == 10_000.0
    assert (summary.electrical_budget_w, summary.budget_origin) == (6_000.0, "feeds")
    assert summary.leased_budget_w == 7_500.0
    assert summary.feeds == {"A": True, "B": False}
    policy = core.policy.policy
    assert [c.priority_class for c in summary.power_by_class] == list(policy.classes)
    assert sum(c.power_w for c in summary.power_by_class) == 8 * 200.0
    assert summary.floor_w is not None
    assert 0 < summary.floor_w <= summary.power_w


def _spec() -> RowSpec:
    return RowSpec.model_validate(_row())


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("budget"),
                st.floats(0, 1e6),
                st.integers(0, 20),
                st.integers(0, 6),
                st.sampled_from(["site-a", "site-b", "mallory"]),
            ),
            st.tuples(
                st.just("meter"),
                st.sampled_from(["up", "down", "unknown", "dark"]),
                st.sampled_from(["up", "down", "unknown", "dark"]),
            ),
            st.tuples(st.just("wait"), st.floats(0, 40)),
        ),
        max_size=30,
    )
)
def test_no_sequence_of_messages_takes_a_row_above_its_budget_or_a_loss_raises_it(
    events: list[tuple[Any, ...]],
) -> None:
    spec = _spec()
    budgets = SiteBudgets(
        {"row1": spec},
        SiteBudgetSettings(issuers=("site-a", "site-b")),
        ClockWindow.of_seconds(5),
    )
    now_ns = S
    for event in events:
        if event[0] == "budget":
            _, watts, seq, term, issuer = event
            budget = decode(_budget(watts, seq=seq, term=term, issuer=issuer), Budget)
            budgets.offer(budget, received_mono_ns=now_ns, received_wall_ns=WALL, retained=False)
        elif event[0] == "meter":
            states = dict(zip(("pdu-a", "pdu-b"), event[1:], strict=True))
            answered = {n: s for n, s in states.items() if s != "dark"}
            missing = {n: "unreachable" for n, s in states.items() if s == "dark"}
            before = budgets.in_force("row1", now_ns)
            budgets.note_meter("row1", decode(_meter(states=answered, missing=missing), Meter))
            after = budgets.in_force("row1", now_ns)
            if "up" not in event[1:]:  # nothing came back: no budget may rise
                assert after.budget_w <= before.budget_w
        else:
            now_ns += round(event[1] * S)
        in_force = budgets.in_force("row1", now_ns)
        assert 0 <= in_force.budget_w <= spec.budget_w
        if in_force.origin == "fallback":
            assert in_force.budget_w == spec.fallback_budget_w


def test_a_feeds_loss_brakes_a_node_whose_agent_is_quiet_through_its_bmc(
    tmp_path: Path,
) -> None:
    """The cut to the surviving feed raises the row's level at once; n1, whose agent went
    quiet, is capped through its BMC (the out-of-band path), n2 (no BMC) is not."""
    settings = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[_row(fallback_budget_w=None, meter_max_w=12_000.0)],
        control={"warmup_s": 0.0, "stale_after_s": 5.0, "lease_s": 10.0},
        bmc={
            "agent_back_s": 0.0,
            "nodes": {
                "n1": {
                    "endpoint": {"url": "http://127.0.0.1:9", "allow_http": True},
                    "fail_safe_w": 2500.0,
                }
            },
        },
    )
    store = PolicyStore(POLICY)
    store.reload()
    core = AggregatorCore(settings, policy_store=store, epoch_ns=1, log=structlog.get_logger())
    core.rows.start(0.0)
    both = _meter(states={"pdu-a": "up", "pdu-b": "up"}, power_w=7_000.0)
    for node in ("n1", "n2"):
        _send(core, f"r1/{node}/telemetry", _telemetry(node), now_s=1.0)
    _send(core, "meter", both, now_s=1.0)
    calm = core.step(1.0, now_ns=WALL, now_mono_ns=S)
    assert calm is not None
    assert calm.result.rows[0].decision.level == 0
    assert calm.oob == []
    # Both agents fall quiet (stale after 5 s); then feed B's breaker trips.
    _send(core, "meter", both, now_s=7.0)
    assert core.step(7.0, now_ns=WALL, now_mono_ns=7 * S).oob == []  # type: ignore[union-attr]
    tripped = _meter(states={"pdu-a": "up", "pdu-b": "down"}, power_w=7_000.0)
    assert _send(core, "meter", tripped, now_s=7.5)
    cut = core.step(7.5, now_ns=WALL, now_mono_ns=round(7.5 * S))
    assert cut is not None
    row = cut.result.rows[0]
    assert (row.electrical.budget_w, row.electrical.origin) == (6_000.0, "feeds")
    assert row.decision.level >= 2
    assert [(t.node, t.watts) for t in cut.oob] == [("n1", 2500.0)]
