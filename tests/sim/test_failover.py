"""A feed's loss replayed on a Flex row: the cut's timing, the survivor check, the worst
moment, the planner's count with zero reserved power, and the command line's refusals."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polca.policy import Policy, parse_policy
from polca.sim import cli, failover
from polca.sim.failover import FeedFailure
from polca.sim.model import BudgetCut, SimConfigError
from polca.sim.plan import Slo, Variant, run_plan
from polca.sim.runner import RunResult, run
from polca.sim.scenario import row_config, run_once
from polca.sim.workload import load_trace
from tests.sim.conftest import (
    A100_POLICY,
    ALWAYS_CAPPED_YAML,
    config,
    row,
    tiny_scenario,
    workload,
)

BOTH_LP = np.array([1, 1])
# One level at 90% of the budget in force, locking every GPU at 705 MHz (half the clock).
AT_90 = ALWAYS_CAPPED_YAML.replace("threshold_pct: 1", "threshold_pct: 90")
# Two GPUs decoding one long request each: 1000 W + 2 x 180 W uncapped, 2 x 147.07 W at 705 MHz.
UNCAPPED_W = 1360.0
CAPPED_W = 1000.0 + 2 * (80.0 + 100.0 * (0.6 + 0.4 * 0.5**2.5))
SURVIVOR_W = 1330.0


@pytest.fixture(scope="module")
def at_90() -> Policy:
    return parse_policy(AT_90, source="at-90.yaml").policy


def _decoding_run(
    policy: Policy | None, cut: BudgetCut | None, *, actuation_s: float = 0.012
) -> RunResult:
    """A 2 kW row of one 2-GPU server decoding steadily for 30 s, controlled every 2 s on
    fresh readings."""
    cfg = replace(
        config(
            row(budget_w=2000.0),
            telemetry_period_s=2.0,
            telemetry_delay_s=0.0,
            actuation_delay_s=actuation_s,
        ),
        budget_cut=cut,
        record_work=True,
    )
    w = workload([(0.0, 100, 3000), (0.01, 100, 3000)], duration_s=30.0)
    return run(cfg, w, policy=policy, gpu_cls=BOTH_LP)


def test_the_cut_takes_effect_failover_s_after_the_loss(at_90: Policy) -> None:
    """Lost at 10 s, known 2.5 s later: the controller steps at 12.5 s (off its 2 s grid) on
    the survivor's rating, the cap lands at the next step, and the row stays under it."""
    cut = BudgetCut(at_s=10.0, budget_w=SURVIVOR_W, known_after_s=2.5)
    result = _decoding_run(at_90, cut)
    ticks = [round(t, 6) for t in result.tick_s.tolist()]
    assert 12.5 in ticks
    wake = ticks.index(12.5)
    assert result.tick_budget_w[:wake].tolist() == [2000.0] * wake
    assert set(result.tick_budget_w[wake:].tolist()) == {SURVIVOR_W}
    assert result.level[:wake, 0].tolist() == [0] * wake  # 1360 W is 68% of 2 kW
    assert result.level[wake, 0] == 1  # and 102% of the survivor
    power = result.row_power_w[:, 0]
    assert power[100:126] == pytest.approx([UNCAPPED_W] * 26)  # 10.0 to 12.6 s: full budget
    assert power[126:] == pytest.approx([CAPPED_W] * (len(power) - 126))
    assert result.brakes == ()  # 2.6 s over the survivor, under the brake's 5 s

    base = _decoding_run(None, None)
    block = failover.measure(result, base, cut=cut)
    assert block["window_s"] == pytest.approx(2.6)
    assert block["window"]["over_survivor_s"] == pytest.approx(2.6)
    assert block["window"]["peak_pct_of_survivor"] == pytest.approx(100 * UNCAPPED_W / SURVIVOR_W)
    assert block["after"]["over_survivor_s"] == 0.0
    assert block["after"]["peak_w"] == pytest.approx(CAPPED_W)
    assert block["longest_over_survivor_s"] == pytest.approx(2.6)
    assert block["top_level"] == "T1"
    assert failover.violations(block) == []
    # The cap's cost during the outage: decode at half the clock, against uncapped.
    assert block["after"]["cost"]["low"]["throughput_loss_pct"] > 5.0


def test_a_slow_cap_leaves_the_row_over_the_survivor_and_the_brake_guards_the_cut(
    at_90: Policy,
) -> None:
    """Out-of-band (40 s) caps come after the run: over the survivor after the window is a
    failure, and the brake fires 5 s after the loss, against the cut budget."""
    cut = BudgetCut(at_s=10.0, budget_w=SURVIVOR_W, known_after_s=2.0)
    result = _decoding_run(at_90, cut, actuation_s=40.0)
    base = _decoding_run(None, None)
    block = failover.measure(result, base, cut=cut)
    assert block["after"]["over_survivor_s"] > 5.0
    assert block["after"]["first_over_survivor_after_loss_s"] == pytest.approx(2.1)
    [why] = failover.violations(block)
    assert why.startswith("feed failure: over the surviving 1.3 kW for ")
    assert result.brakes[0].over_since_s == pytest.approx(10.0)
    assert result.brakes[0].fired_s == pytest.approx(15.0)
    assert block["brake_events"] == len(result.brakes) >= 1


def test_the_budget_returns_when_the_outage_ends(at_90: Policy) -> None:
    """With the feed back at 20 s, the controller runs on the row's budget again."""
    cut = BudgetCut(at_s=10.0, budget_w=SURVIVOR_W, known_after_s=2.0, until_s=20.0)
    result = _decoding_run(at_90, cut)
    ticks = [round(t, 6) for t in result.tick_s.tolist()]
    by_tick = dict(zip(ticks, result.tick_budget_w.tolist(), strict=True))
    assert by_tick[10.0] == 2000.0
    assert by_tick[12.0] == by_tick[18.0] == SURVIVOR_W
    assert by_tick[20.0] == by_tick[28.0] == 2000.0
    block = failover.measure(result, _decoding_run(None, None), cut=cut)
    assert block["outage_end_s"] == pytest.approx(20.0)
    assert block["after"]["duration_s"] == pytest.approx(20.0 - 12.1)
    assert not block["outage_to_end_of_run"]


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"at_s": -1.0}, "starts at a time >= 0 s"),
        ({"budget_w": math.nan}, "positive number of watts"),
        ({"budget_w": -5.0}, "positive number of watts"),
        ({"known_after_s": math.inf}, "known_after_s must be >= 0"),
        ({"until_s": 5.0}, "ends after it starts"),
        ({"until_s": math.nan}, "ends after it starts"),
    ],
)
def test_a_budget_cut_is_checked(changes: dict[str, float], fragment: str) -> None:
    values: dict[str, float] = {"at_s": 10.0, "budget_w": 1000.0, **changes}
    with pytest.raises(SimConfigError, match=fragment):
        BudgetCut(**values)


def test_a_cut_above_the_budget_is_refused(at_90: Policy) -> None:
    """A feed's loss never raises a row's budget."""
    with pytest.raises(SimConfigError, match="never raises a budget"):
        _decoding_run(at_90, BudgetCut(at_s=1.0, budget_w=2500.0))


def test_the_worst_moment_is_the_failover_long_interval_of_highest_power() -> None:
    """A one-step spike loses to a plateau over a 2 s window, wins over one step; the
    warm-up and an outage that must fit in the run bound the search."""
    base = _decoding_run(None, None)
    power = np.full((300, 1), 100.0)
    power[30] = 500.0  # 3.0 s: one step
    power[60:80] = 300.0  # 6.0-8.0 s: a plateau
    power[200:220] = 250.0  # 20.0-22.0 s: a lower one
    fake = replace(base, row_power_w=power)
    assert failover.worst_moment_s(fake, window_s=2.0, warmup_s=0.0) == pytest.approx(6.0)
    assert failover.worst_moment_s(fake, window_s=0.1, warmup_s=0.0) == pytest.approx(3.0)
    assert failover.worst_moment_s(fake, window_s=0.0, warmup_s=0.0) == pytest.approx(3.0)
    assert failover.worst_moment_s(fake, window_s=2.0, warmup_s=10.0) == pytest.approx(20.0)
    # An outage of 15 s must start by 15 s: the later plateau is out of reach.
    assert failover.worst_moment_s(
        fake, window_s=2.0, warmup_s=7.0, latest_s=15.0
    ) == pytest.approx(7.0)


def test_the_replay_is_the_capped_run_until_the_loss(a100_policy: Policy) -> None:
    """At the worst moment of the point's own capped run, the replay follows that run step
    for step until the loss, then the survivor's rating caps it."""
    s = tiny_scenario(
        duration_s=150.0,
        oversubscription=0.5,
        record_work=True,
        control=replace(tiny_scenario().control, actuation_delay_s=0.012),
    )
    trace = load_trace("azure-code")
    normal, base = run_once(s, trace, a100_policy), run_once(s, trace, None)
    budget_w = row_config(s).budget_w
    spec = FeedFailure(feed_w=budget_w / 2)
    block = failover.replay(spec, s, trace, a100_policy, normal=normal, base=base)
    at_s = failover.worst_moment_s(normal, window_s=2.0, warmup_s=s.warmup_s)
    assert block["at_s"] == pytest.approx(at_s)
    k, first = round(at_s / s.step_s), round(s.warmup_s / s.step_s)
    means = [
        normal.row_power_w[i : i + 20].mean() for i in range(first, len(normal.row_power_w) - 19)
    ]
    assert normal.row_power_w[k : k + 20].mean() == pytest.approx(max(means))
    failed = run_once(
        replace(s, budget_cut=BudgetCut(at_s=at_s, budget_w=budget_w / 2)), trace, a100_policy
    )
    assert np.array_equal(failed.row_power_w[:k], normal.row_power_w[:k])
    assert not np.array_equal(failed.row_power_w[k:], normal.row_power_w[k:])
    assert block["survivor_w"] == pytest.approx(budget_w / 2)


def _tiny_trace(tmp_path: Path) -> Path:
    """One request a second of one token in and one out: a decode step's worth of power
    each (125 W for 0.1 s on an A100 server) over the row's idle power."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{i // 60:02d}:{i % 60:02d},1,1" for i in range(600)]
    path = tmp_path / "idle.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_count_with_zero_reserved_power_is_the_survivor_over_a_server(
    tmp_path: Path, a100_policy: Policy
) -> None:
    """A row at constant (idle) power, give or take a request's step, budgeted at two feeds
    of 6.5 servers' idle power each: 6 servers stay under one feed after its partner's
    loss, 7 cannot (no cap lowers idle power), while without the failure every swept count
    meets the SLOs."""
    s = tiny_scenario(
        duration_s=120.0,
        load_scale=0.1,  # under one request a second: the row is idle but for short blips
        control=replace(tiny_scenario().control, actuation_delay_s=0.012),
    )
    idle_w = row_config(s).idle_power_w / s.servers
    feed_w = 6.5 * idle_w
    s = replace(s, budget_w=2 * feed_w)
    trace = load_trace(_tiny_trace(tmp_path))
    plan = run_plan(
        s,
        trace,
        [Variant("in-band", a100_policy, s.control)],
        ratios=[0.0, 0.5, 0.75, 1.0],  # 4, 6, 7 and 8 servers
        slo=Slo(),
        feed_failure=FeedFailure(feed_w=feed_w),
    )
    assert plan["feed_failure"]["survivor_w"] == pytest.approx(feed_w)
    [v] = plan["scenarios"]
    assert [p["servers"] for p in v["points"]] == [4, 6, 7, 8]
    assert v["best_servers"] == math.floor(feed_w / idle_w) == 6
    assert v["best_servers_without_feed_failure"] == 8
    by_servers = {p["servers"]: p for p in v["points"]}
    for n, p in by_servers.items():
        block = p["feed_failure"]
        idle_pct = 100 * n * idle_w / feed_w
        assert idle_pct <= block["window"]["peak_pct_of_survivor"] <= idle_pct + 2.5
        assert (block["after"]["over_survivor_s"] > 0) == (n >= 7)
        assert block["window_s"] == pytest.approx(2.1)
    assert by_servers[7]["violations"][0].startswith("feed failure: over the surviving")
    # Over for the whole window and, no cap lowering idle power, for all the rest.
    seven = by_servers[7]["feed_failure"]
    assert seven["window"]["over_survivor_s"] == pytest.approx(2.1)
    assert seven["after"]["over_survivor_s"] == pytest.approx(seven["after"]["duration_s"])
    assert seven["top_level"] == "brake"


def test_several_seeds_report_the_worst() -> None:
    """The worst seed's replay stands for the point, every seed's kept; collapsed is worst."""

    def block(over_s: float, peak_w: float) -> dict[str, Any]:
        return {
            "survivor_w": 1000.0,
            "window": {"peak_w": peak_w},
            "after": {"over_survivor_s": over_s, "peak_pct_of_survivor": 120.0},
        }

    blocks = [block(0.0, 1500.0), block(3.0, 1100.0), block(0.0, 1900.0)]
    merged = failover.merge_seeds(blocks, [7, 8, 9])
    assert merged["worst_seed"] == 8
    assert merged["by_seed"] == blocks
    assert failover.merge_seeds(blocks[::2], [7, 9])["worst_seed"] == 9
    collapsed = {"at_s": 40.0, "collapsed": "collapsed at t=50 s"}
    assert failover.merge_seeds([blocks[1], collapsed], [1, 2])["worst_seed"] == 2
    assert failover.violations(collapsed) == ["feed failure: collapsed (collapsed at t=50 s)"]
    assert failover.violations(None) == []


TINY = ["--servers", "4", "--gpus-per-server", "4", "--duration", "2m", "--warmup", "20"]


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(cli.parse(["plan", "--policy", str(A100_POLICY), *argv]), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_plan_reports_the_feed_failure_in_text_json_and_csv(tmp_path: Path) -> None:
    """The table of the replay beside the plan's, the verdict with the survivor, keys with
    units in the JSON, the survivor's figures in plan.csv."""
    argv = [
        "--actuation", "in-band", "--oversubscription", "0,50%", "--trace",
        str(_tiny_trace(tmp_path)), "--feed-failure", "--feed-w", "11400", "--budget-w",
        "22800", "--failover-s", "1", "--outage-s", "1m", *TINY,
    ]  # fmt: skip
    code, out, err = _run(*argv, "--out", str(tmp_path / "plan"))
    assert code == 0, err
    assert "feed failure: 1 of 2 feeds of 11.4 kW lost at the worst moment" in out
    assert "for 60 s; the row runs on the survivor's 11.4 kW (budget 22.8 kW) 1 s after" in out
    assert "stay under the surviving 11.4 kW after a feed's loss" in out
    header = (tmp_path / "plan" / "plan.csv").read_text().splitlines()[0]
    assert "window_peak_pct_of_survivor" in header
    assert header.endswith("after_over_survivor_s,meets_slo")

    code, out, err = _run(*argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["feed_failure"] == {
        "feed_w": 11400.0,
        "feeds": 2,
        "budget_w": 22800.0,
        "survivor_w": 11400.0,
        "failover_s": 1.0,
        "failure_at": "worst",
        "outage_s": 60.0,
    }
    block = plan["scenarios"][0]["points"][0]["feed_failure"]
    assert block["window_s"] == pytest.approx(1.1)
    assert block["outage_end_s"] == pytest.approx(block["at_s"] + 60.0)
    assert block["at_s"] + 60.0 <= 120.0  # the outage kept inside the run
    for part in ("window", "after"):
        assert {"peak_w", "peak_pct_of_survivor", "over_survivor_s"} <= set(block[part])
        assert {"p99_impact_pct", "throughput_loss_pct"} <= set(block[part]["cost"]["high"])


def test_plan_takes_a_given_failure_time() -> None:
    """--failure-at T replays the loss at T (here 90 s = 1.5m)."""
    code, out, err = _run(
        "--actuation", "in-band", "--oversubscription", "0", "--feed-failure",
        "--feed-w", "11400", "--failure-at", "1.5m", "--json", *TINY,
    )  # fmt: skip
    assert code == 0, err
    block = json.loads(out)["scenarios"][0]["points"][0]["feed_failure"]
    assert block["at_s"] == pytest.approx(90.0)
    assert json.loads(out)["feed_failure"]["failure_at"] == 90.0


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--feed-w", "-5"], "--feed-w must be a rating above 0 W"),
        (["--feed-w", "nan"], "--feed-w must be a rating above 0 W"),
        (["--feed-w", "inf"], "--feed-w must be a rating above 0 W"),
        (["--feed-w", "0"], "--feed-w must be a rating above 0 W"),
        (["--feed-w", "30000"], "is above the row's budget of 22800 W"),
        (["--feed-w", "22800"], "a feed's loss cuts nothing"),
        (["--feed-w", "12000", "--feeds", "3"], "a feed's loss cuts nothing"),
        (["--feed-w", "5000"], "give --budget-w 10000 or less"),
        (["--feed-w", "11400", "--feeds", "1"], "--feeds must be 2 to 64"),
        (["--feed-w", "11400", "--failover-s", "nan"], "--failover-s must be >= 0 s"),
        (["--feed-w", "11400", "--failover-s", "-1"], "--failover-s must be >= 0 s"),
        (["--feed-w", "11400", "--failover-s", "500"], "--failover-s must be >= 0 s"),
        (["--feed-w", "11400", "--failure-at", "soon"], "--failure-at must be 'worst' or a time"),
        (["--feed-w", "11400", "--failure-at", "10"], "a time within the run after warm-up"),
        (["--feed-w", "11400", "--failure-at", "3m"], "a time within the run after warm-up"),
        (["--feed-w", "11400", "--outage-s", "0"], "--outage-s must be a duration above 0 s"),
        (["--feed-w", "11400", "--outage-s", "nan"], "--outage-s must be a duration"),
    ],
)
def test_hostile_feed_arguments_are_refused_in_one_line(
    argv: list[str], fragment: str, tmp_path: Path
) -> None:
    """Exit 2 and one line naming the option, before anything runs or is written."""
    code, out, err = _run("--feed-failure", *argv, *TINY, "--out", str(tmp_path / "plan"))
    assert code == 2
    assert out == ""
    assert not (tmp_path / "plan").exists()
    assert err.count("\n") == 1
    assert fragment in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--feed-w", "11400"], "--feed-w: only with --feed-failure"),
        (["--outage-s", "10m", "--feeds", "2"], "--feeds, --outage-s: only with --feed-failure"),
        (["--feed-failure"], "--feed-failure needs --feed-w"),
        (
            ["--feed-failure", "--feed-w", "11400", "--history", "row.csv"],
            "does not apply to --history",
        ),
    ],
)
def test_feed_options_need_each_other(argv: list[str], fragment: str) -> None:
    code, _, err = _run(*argv, *TINY)
    assert code == 2
    assert err.count("\n") == 1
    assert fragment in err
