"""Plans from a row's recorded power: the history readers (CSV and InfluxDB 1.x, hostile
input refused by line), the replay's physics, and the plan closing the loop on polca's own
InfluxDB output."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given

from polca.aggregator.points import row_point
from polca.errors import SimConfigError, TraceError
from polca.export.points import encode_lines, make_point
from polca.policy import Policy
from polca.sim import cli
from polca.sim.history import plan_history, replay
from polca.sim.model import ControlConfig, server_preset, sim_gpu
from polca.sim.plan import Slo, Variant
from polca.sim.power_history import PowerHistory, load_history_csv, load_history_influx, resample
from tests.fuzzing import FUZZ, mutated
from tests.sim.conftest import A100_POLICY
from tests.tsdb import InfluxDB1Process, influxdb1

__all__ = ["influxdb1"]

A100 = sim_gpu("A100-SXM4")
SERVER = server_preset("A100-SXM4")
BASE = 10
BUDGET_W = BASE * SERVER.provisioned_w


def _history(pcts: list[float], *, step_s: float = 2.0, repeat: int = 1) -> PowerHistory:
    """A row of BASE servers drawing these shares of its budget, step by step."""
    watts = np.repeat(np.array(pcts) / 100.0 * BUDGET_W, repeat)
    return PowerHistory(source="test", step_s=step_s, power_w=watts)


def _replay(
    history: PowerHistory, policy: Policy | None, servers: int, **kw: object
) -> dict[str, Any]:
    return replay(
        history,
        gpu=A100,
        server=SERVER,
        base_servers=BASE,
        servers=servers,
        gpus_per_server=8,
        budget_w=BUDGET_W,
        policy=policy,
        control=ControlConfig(actuation_delay_s=0.012),
        warmup_s=0.0,
        **kw,  # type: ignore[arg-type]
    )


def test_a_csv_history_is_read_and_averaged_onto_the_step(tmp_path: Path) -> None:
    """Epoch or ISO timestamps; readings averaged per step; a skipped beat carries the last."""
    from datetime import UTC, datetime

    t0 = int(datetime(2026, 11, 30, tzinfo=UTC).timestamp())
    path = tmp_path / "row.csv"
    path.write_text(
        "timestamp,power_w\n"
        f"2026-11-30T00:00:00Z,1000\n{t0 + 1},3000\n"
        f"2026-11-30T00:00:02+00:00,5000\n{t0 + 7},7000\n",
        encoding="utf-8",
    )
    history = load_history_csv(path, step_s=2.0)
    assert history.step_s == 2.0
    assert list(history.power_w) == [2000.0, 5000.0, 5000.0, 7000.0]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("time,watts\n1,2\n2,3\n", ":1: the header must be"),
        ("timestamp,power_w,hp_power_w\n1,2,3\n2,3,4\n", "give both"),
        ("timestamp,power_w\n1,100\n1,200\n", ":3: timestamps must increase"),
        ("timestamp,power_w\n1,100\n2,-5\n", ":3: power must be finite"),
        ("timestamp,power_w\n1,100\n2,nan\n", ":3: power must be finite"),
        ("timestamp,power_w\n1,100\n2\n", ":3: 1 fields, expected 2"),
        ("timestamp,power_w\n1,100\nyesterday,5\n", ":3: not a timestamp"),
        ("timestamp,power_w\n1,100\n", "at least two readings"),
    ],
)
def test_a_bad_history_names_its_line(tmp_path: Path, body: str, fragment: str) -> None:
    """Every bad row is a TraceError naming FILE:LINE."""
    path = tmp_path / "bad.csv"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(TraceError, match=r"bad\.csv") as info:
        load_history_csv(path, step_s=2.0)
    assert fragment in str(info.value)
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"timestamp,power_w\n1,100\n2,\xff\n")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_history_csv(latin, step_s=2.0)


def test_uncapped_replay_scales_the_recorded_shape_per_server() -> None:
    """No policy: the recorded row at its own size peaks where it peaked; each added
    server adds the average recorded server."""
    history = _history([60.0, 70.0, 80.0, 75.0], repeat=30)
    same = _replay(history, None, BASE)
    assert same["peak_pct"] == pytest.approx(80.0)
    assert same["uncapped_peak_pct"] == pytest.approx(80.0)
    more = _replay(history, None, 13)
    assert more["peak_pct"] == pytest.approx(80.0 * 1.3)
    assert more["capped_time_pct"] == 0.0
    assert more["hp_p99_impact_pct"] == 0.0


def test_caps_cut_power_and_cost_latency_where_the_row_runs_high(a100_policy: Policy) -> None:
    """Below T1 nothing happens; a row pushed over T2 spends time capped, draws less than
    uncapped and pays in latency, low priority more than high."""
    quiet = _history([50.0, 55.0, 60.0], repeat=60)
    calm = _replay(quiet, a100_policy, 12)
    assert calm["capped_time_pct"] == 0.0
    assert calm["lp_throughput_loss_pct"] == 0.0
    busy = _history([60.0, 70.0, 76.0, 78.0, 65.0], repeat=60)  # x1.2: up to 94%
    hot = _replay(busy, a100_policy, 12)
    assert hot["capped_time_pct"] > 20.0
    assert hot["capping_events"] >= 1
    assert hot["peak_pct"] < hot["uncapped_peak_pct"]
    assert hot["lp_p99_impact_pct"] > hot["hp_p99_impact_pct"] >= 0.0
    assert hot["lp_throughput_loss_pct"] > 0.0
    assert hot["brake_events"] == 0.0


def test_an_overloaded_row_brakes() -> None:
    """Far over budget for longer than the brake tolerance: brake events are counted."""
    from polca.policy import load_policy

    policy = load_policy(A100_POLICY).policy
    over = _history([70.0, 99.0, 99.0, 99.0, 70.0], repeat=10)
    run = _replay(over, policy, 14)
    assert run["brake_events"] >= 1
    assert math.isfinite(run["peak_pct"])


def test_a_history_plan_finds_a_frontier(a100_policy: Policy) -> None:
    """The same plan shape as from a trace; more servers never help (monotone)."""
    busy = _history([55.0, 65.0, 75.0, 79.0, 70.0, 60.0], repeat=100)
    result = plan_history(
        busy,
        [Variant("in-band", a100_policy, ControlConfig(actuation_delay_s=0.012))],
        ratios=[0.0, 0.1, 0.2, 0.3, 0.5],
        slo=Slo(),
        gpu=A100,
        server=SERVER,
        base_servers=BASE,
        gpus_per_server=8,
        budget_w=BUDGET_W,
        warmup_s=0.0,
    )
    (variant,) = result["scenarios"]
    points = variant["points"]
    capped = [p["capped_time_pct"] for p in points]
    assert capped == sorted(capped)
    assert points[0]["violations"] == []
    assert variant["best"] is not None
    assert points[-1]["violations"]  # +50% on a row that peaked at 79% does not fit
    assert result["history"]["source"] == "test"


def test_resample_refuses_nonsense() -> None:
    """A step of zero is an input error."""
    with pytest.raises(SimConfigError, match="step"):
        resample(np.array([0.0, 1.0]), {"power_w": np.array([1.0, 2.0])}, step_s=0.0, source="x")


def test_the_loop_closes_on_polcas_own_influxdb(influxdb1: InfluxDB1Process) -> None:
    """Row points as the aggregator writes them go into InfluxDB 1.x; `polca plan
    --history http://.../polca --history-row row1` reads them back and plans."""
    import time

    start_ms = (time.time_ns() // 1_000_000) - 3_600_000
    pcts = [55.0, 65.0, 75.0, 79.0, 70.0, 60.0] * 50
    points = [
        row_point(
            ts_ns=(start_ms + 2_000 * i) * 1_000_000,
            site="dc1",
            row="row1",
            power_w=pct / 100.0 * BUDGET_W,
            budget_w=BUDGET_W,
        )
        for i, pct in enumerate(pcts)
    ]
    other = row_point(ts_ns=start_ms * 1_000_000, site="dc1", row="row2", power_w=1.0)
    gpus = [
        make_point(
            "gpu",
            ts_ns=(start_ms + 2_000 * i) * 1_000_000,
            tags={
                "site": "dc1",
                "row": "row1",
                "rack": "rack1",
                "node": f"n{g // 2}",
                "gpu_uuid": f"GPU-{g}",
                "gpu_index": str(g % 2),
                "model": "A100",
                "class": "high" if g < 2 else "low",
            },
            fields={"power_w": 100.0 + 10 * g + (i % 6)},
        )
        for i in range(len(pcts))
        for g in range(4)
    ]
    influxdb1.write(encode_lines([*points, other, *gpus]))
    history = load_history_influx(
        f"{influxdb1.url}/polca", row="row1", site="dc1", step_s=2.0, since="2h"
    )
    assert len(history.power_w) == len(pcts)
    assert history.power_w.max() == pytest.approx(0.79 * BUDGET_W)
    # Per class: the sum over the class's GPUs (two each) at every step.
    assert history.hp_power_w is not None
    assert history.lp_power_w is not None
    steps = np.arange(len(pcts)) % 6
    assert list(history.hp_power_w) == pytest.approx(list(210.0 + 2 * steps))
    assert list(history.lp_power_w) == pytest.approx(list(250.0 + 2 * steps))
    total_only = load_history_influx(
        f"{influxdb1.url}/polca", row="row1", step_s=2.0, since="2h", classes=("gold", "low")
    )
    assert total_only.hp_power_w is None  # a class the data does not have: the total only
    with pytest.raises(SimConfigError, match="letters, digits"):
        load_history_influx(f"{influxdb1.url}/polca", row="r' OR 1=1", step_s=2.0)
    out, err = io.StringIO(), io.StringIO()
    argv = ["plan", "--policy", str(A100_POLICY), "--actuation", "in-band"]
    argv += [
        "--history",
        f"{influxdb1.url}/polca",
        "--history-row",
        "row1",
        "--history-site",
        "dc1",
    ]
    argv += ["--history-since", "2h", "--servers", str(BASE), "--oversubscription", "0,20%,60%"]
    argv += ["--warmup", "0", "--seeds", "3"]
    code = cli.main(cli.parse(argv), out=out, err=err)
    assert code == 0, err.getvalue()
    assert "history:" in err.getvalue()
    assert "--seeds do not apply to --history: ignored" in err.getvalue()
    text = out.getvalue()
    assert "polca-a100 in-band" in text
    assert "servers (+" in text or "no swept deployment" in text


_CSV = "timestamp,power_w,hp_power_w,lp_power_w\n" + "".join(
    f"{1_800_000_000 + 2 * i},{20_000 + 100 * (i % 7)},{8_000 + i},{9_000 - i}\n" for i in range(30)
)


@FUZZ
@given(text=mutated(_CSV))
def test_fuzz_mutated_histories_only_raise_trace_error(
    text: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A mutated history CSV loads (finite watts >= 0, on a uniform step) or is a
    TraceError or SimConfigError naming the file, nothing else."""
    path = tmp_path_factory.getbasetemp() / "history-fuzz.csv"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        history = load_history_csv(path, step_s=2.0)
    except (TraceError, SimConfigError) as exc:
        error = str(exc)
    else:
        assert np.all(np.isfinite(history.power_w))
        assert np.all(history.power_w >= 0)
        return
    assert "history-fuzz.csv" in error, error


def test_history_plan_takes_the_server_options(tmp_path: Path) -> None:
    """--server-other-w and --server-overhead reach the replay, as for a trace: with more
    steady non-GPU power per server (or more overhead), less of the recorded row is GPU
    power a clock cap lowers, so the capped peak is higher (the uncapped one, the recorded
    shape scaled per server, stays)."""
    path = tmp_path / "row.csv"
    rows = [f"{1_800_000_000 + 2 * i},{BUDGET_W * (0.6 + 0.2 * (i % 5) / 4)}" for i in range(60)]
    path.write_text("timestamp,power_w\n" + "\n".join(rows) + "\n")

    def peak(*extra: str) -> float:
        argv = ["plan", "--policy", str(A100_POLICY), "--actuation", "in-band", "--warmup", "0"]
        argv += ["--history", str(path), "--servers", str(BASE), "--oversubscription", "30%"]
        argv += ["--no-plots", "--out", str(tmp_path / "plan"), *extra]
        out, err = io.StringIO(), io.StringIO()
        assert cli.main(cli.parse(argv), out=out, err=err) == 0, err.getvalue()
        plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
        point = plan["scenarios"][0]["points"][0]
        assert point["uncapped_peak_pct"] == pytest.approx(130.0 * 0.8)
        return float(point["peak_pct"])

    default = peak()
    more_other = peak("--server-other-w", str(SERVER.other_w + 1000.0))
    more_overhead = peak("--server-overhead", str(SERVER.overhead_frac + 0.2))
    assert more_other > default + 0.01  # the options were ignored once: equal peaks
    assert more_overhead > default + 0.01
