"""`polca demo`, the README's main job, run as a user would."""

from __future__ import annotations

import csv
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest


def test_demo_row_reaches_caps_and_prints_a_summary(tmp_path: Path) -> None:
    """Embedded broker, aggregator, trace-driven simulated nodes: levels, caps, a summary."""
    budget_w = 19000
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "polca",
            "demo",
            "--racks",
            "2",
            "--nodes-per-rack",
            "2",
            "--duration",
            "30",
            "--budget-w",
            str(budget_w),
            "--record",
            "record",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "embedded MQTT broker on 127.0.0.1:" in out
    assert re.search(r"row\s+\d+\.\d kW\s+\d+\.\d%", out)
    assert re.search(r"rack1\s+\d+\.\d kW", out)
    assert "== polca demo summary ==" in out
    levels = dict(re.findall(r"time at (\S+)\s*:\s+(\d+) s", out))
    assert set(levels) & {"T1", "T2", "brake"}, out[-2000:]
    changes = re.search(r"GPU cap changes\s+: (\d+)", out)
    assert changes
    assert int(changes.group(1)) > 0
    peak = re.search(r"peak row power\s+: ([\d.]+)% of the [\d.]+ kW budget with polca; "
                     r"([\d.]+)% without \(the same load, uncapped\)", out)  # fmt: skip
    assert peak, out[-1500:]
    assert float(peak.group(1)) > 50
    # Caps only ever lower the peak, but the two peaks are 1 s means on windows that are not
    # aligned (each agent's own, the view's): they can differ by what the load does in 1 s.
    with (tmp_path / "record" / "uncapped.csv").open() as f:
        uncapped_w = [float(row["power_w"]) for row in csv.DictReader(f)]
    rise_pct = max(b - a for a, b in itertools.pairwise(uncapped_w)) * 100.0 / budget_w
    assert max(uncapped_w) * 100.0 / budget_w == pytest.approx(float(peak.group(2)), abs=0.06)
    assert float(peak.group(1)) <= float(peak.group(2)) + rise_pct, (rise_pct, out[-1500:])
    # Feed B is lost 20 s in: the row runs on feed A's 60% of its budget, at once.
    lost = re.search(r"feed B lost\s+: (\d+) s on feed A alone, the budget cut to ([\d.]+) kW", out)
    assert lost, out[-1500:]
    assert int(lost.group(1)) >= 5
    assert float(lost.group(2)) == pytest.approx(0.6 * budget_w / 1000, abs=0.05)
    assert "feeds A up, B DOWN; budget 11.4 kW from feeds" in out
    servers = re.search(r"servers\s+: 4 nodes on a budget that holds (\d+) at this load", out)
    assert servers, out[-1500:]
    given = re.search(r"clock given up\s+: high ([-+][\d.]+)%, low ([-+][\d.]+)%", out)
    assert given, out[-1500:]
    assert float(given.group(2)) <= float(given.group(1)) <= 0.5  # low gives up the most
    cost = re.search(r"latency cost\s+: high ([-+][\d.]+)%, low ([-+][\d.]+)% \(the planner", out)
    assert cost, out[-1500:]
    assert float(cost.group(2)) >= float(cost.group(1)) >= -0.5  # low pays the most
    assert float(cost.group(2)) > 0.0  # the row was capped, so low-priority work slowed


def test_tenants_are_dealt_over_the_racks_at_their_own_phases() -> None:
    """Node n serves tenant n % tenants; each tenant's replay starts at its own phase with
    its share of the load; one tenant is the whole row's single replay."""
    from polca.demo.load import tenant_replays
    from polca.demo.options import DemoOptions
    from polca.workload.trace import Trace

    trace = Trace.load()
    options = DemoOptions()
    replays = tenant_replays(options, trace)
    assert len(replays) == len(options.nodes)
    tenants = {id(r) for r, _ in replays}
    assert len(tenants) == options.tenants
    for n, (replay, local) in enumerate(replays):
        assert replays[n % options.tenants][0] is replay
        assert local == n // options.tenants
        assert replay.scale == options.scale / options.tenants
    offsets = sorted({r.offset_s for r, _ in replays})
    assert len(offsets) == options.tenants
    single = tenant_replays(DemoOptions(tenants=1), trace)
    assert len({id(r) for r, _ in single}) == 1
    assert single[0][0].scale == options.scale


def test_the_planner_signs_the_demo_default(tmp_path: Path) -> None:
    """``polca plan --history`` on ten minutes of the default demo's own uncapped load
    (computed without the daemons) says its 12 servers meet POLCA's SLOs with zero brake
    events and the brake level never reached, while the load does exceed the budget (the
    row is oversubscribed); the old default (one tenant, POLCA's thresholds, 75% of
    nameplate) is refused. bench/demo_plan.py runs the same check over 30 minutes."""
    from polca.demo.load import uncapped_load
    from polca.demo.options import DEMO_POLICY, DemoOptions
    from polca.policy import load_policy
    from polca.sim.agreement import plan_demo_row

    def point(options: DemoOptions, policy: Path, name: str) -> dict[str, object]:
        view = uncapped_load(options, 600)
        history = tmp_path / f"{name}.csv"
        view.write_uncapped(history, load_policy(policy).policy.classes)
        return plan_demo_row(
            history, policy_file=policy, row=options.planner_row(), out=tmp_path / name
        )

    signed = point(DemoOptions(), DEMO_POLICY, "default")
    assert signed["violations"] == [], signed
    assert signed["brake_events"] == 0
    assert signed["time_at_level_pct"].get("brake", 0.0) == 0.0  # type: ignore[attr-defined]
    assert float(signed["uncapped_peak_pct"]) > 100.0  # type: ignore[arg-type]
    old_policy = tmp_path / "old.yaml"
    text = DEMO_POLICY.read_text()
    for now_pct, was_pct in (("88", "80"), ("93", "89"), ("96", "93"), ("99", "98")):
        text = text.replace(f"threshold_pct: {now_pct}", f"threshold_pct: {was_pct}")
    old_policy.write_text(text)
    old = point(DemoOptions(tenants=1, budget_fraction=0.75, policy=old_policy), old_policy, "old")
    assert old["violations"], old


def test_bad_demo_options_are_usage_errors() -> None:
    """No tenants, a negative or non-finite trace offset: argparse refuses them, naming the
    option, before anything starts (exit 2, nothing on stdout)."""
    for argv, message in (
        (["--tenants", "0"], "argument --tenants: must be at least 1"),
        (["--tenants", "two"], "argument --tenants: not a whole number"),
        (["--offset-s", "-5"], "argument --offset-s: must be a finite number of 0 or more"),
        (["--offset-s", "nan"], "argument --offset-s: must be a finite number of 0 or more"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "polca", "demo", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr
        assert result.stdout == ""
