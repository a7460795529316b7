"""``polca simulate`` and ``polca plan`` from the command line: outputs and input errors."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polca.sim import cli
from tests.sim.conftest import A100_POLICY

TINY = ["--servers", "4", "--gpus-per-server", "4", "--duration", "2m", "--warmup", "20"]


def run(*argv: str) -> tuple[int, str, str]:
    """Parse and run one command; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(cli.parse(list(argv)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_simulate_prints_a_summary_and_writes_files(tmp_path: Path) -> None:
    """A tiny oversubscribed row: text summary, summary.json, series.csv, two PNGs."""
    code, out, err = run(
        "simulate", "--policy", str(A100_POLICY), "--oversubscription", "50%",
        "--actuation", "in-band", "--out", str(tmp_path), *TINY,
    )  # fmt: skip
    assert code == 0, err
    assert "row: 6 servers x 4 A100-SXM4 (+50% over 4)" in out
    assert "brake events:" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["control"]["actuation"] == "in-band"
    assert summary["control"]["actuation_delay_s"] == pytest.approx(0.012)
    assert summary["policy_file"] == str(A100_POLICY)
    for name in ("series.csv", "power.png", "latency.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_simulate_json_output_is_deterministic() -> None:
    """--json prints the summary; the same seed prints the same numbers."""
    argv = ["simulate", "--policy", str(A100_POLICY), "--json", "--seed", "5", *TINY]
    first, second = run(*argv), run(*argv)
    assert first[0] == 0
    assert first[1] == second[1]
    assert json.loads(first[1])["workload"]["seed"] == 5


def test_malformed_trace_row_is_reported_with_its_line(tmp_path: Path) -> None:
    """Exit 2 and FILE:LINE: naming the bad field."""
    bad = tmp_path / "trace.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03,100,10\n"
        "2023-11-16 18:17:04,100\n",
        encoding="utf-8",
    )
    code, _, err = run("simulate", "--policy", str(A100_POLICY), "--trace", str(bad), *TINY)
    assert code == 2
    assert err.startswith(f"{bad}:3: expected 3 fields, got 2")


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ("2023-11-16 18:17:04,100," + "9" * 3000, "GeneratedTokens must be a whole number"),
        ("2023-11-16 18:17:04,100,10," + "x" * 5000, "line longer than 4096 bytes"),
        ("2023-11-16 18:17:04,\u0661\u0660\u0660,10", "ContextTokens must be a whole number"),
        ('"2023-11-16 18:17:04,100,10', "malformed CSV"),
        ("2024-12-01 00:00:00,100,10", "more than 366 days"),
    ],
)
def test_hostile_trace_rows_are_input_errors(tmp_path: Path, row: str, fragment: str) -> None:
    """Huge numbers, long lines, non-ASCII digits, open quotes, absurd spans: exit 2, FILE:3:."""
    bad = tmp_path / "trace.csv"
    bad.write_text(
        f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,100,10\n{row}\n",
        encoding="utf-8",
    )
    code, _, err = run("simulate", "--policy", str(A100_POLICY), "--trace", str(bad), *TINY)
    assert code == 2
    assert err.startswith(f"{bad}:3: ")
    assert fragment in err


def test_impossible_row_is_an_input_error() -> None:
    """A budget below the idle row: exit 2, the message says why."""
    code, _, err = run("simulate", "--policy", str(A100_POLICY), "--budget-w", "3000", *TINY)
    assert code == 2
    assert "impossible row: 4 servers idle at" in err


def test_invalid_policy_lists_file_line_col(tmp_path: Path) -> None:
    """A policy with a rule error is reported as FILE:LINE:COL, nothing runs."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(A100_POLICY.read_text().replace("threshold_pct: 89", "threshold_pct: 70"))
    code, _, err = run("simulate", "--policy", str(broken), *TINY)
    assert code == 2
    assert f"{broken}:" in err
    assert "thresholds must ascend" in err


def test_plan_prints_a_table_and_writes_the_frontier(tmp_path: Path) -> None:
    """Two ratios, one policy, in-band: a table, plan.json, plan.csv and frontier.png."""
    code, out, err = run(
        "plan", "--policy", str(A100_POLICY), "--actuation", "in-band",
        "--oversubscription", "0,25%", "--out", str(tmp_path), *TINY,
    )  # fmt: skip
    assert code == 0, err
    assert "polca-a100 in-band (actuation 0.012 s):" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [p["servers"] for p in plan["scenarios"][0]["points"]] == [4, 5]
    assert (tmp_path / "plan.csv").read_text().startswith("scenario,oversubscription_pct")
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_missing_extra_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numpy the commands say which extra to install (exit 78)."""
    monkeypatch.setitem(sys.modules, "numpy", None)
    code, _, err = run("simulate", "--policy", str(A100_POLICY))
    assert code == 78
    assert "pip install 'polca[sim]'" in err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("2h", 7200.0), ("1d", 86400.0)],
)
def test_durations(text: str, seconds: float) -> None:
    """Durations take s, m, h and d suffixes."""
    assert cli.duration_s(text) == seconds


def test_ratio_grids() -> None:
    """Ratios as fractions or percentages; START:STOP:STEP grids include STOP."""
    assert cli.ratio("30%") == pytest.approx(0.3)
    assert cli.ratio_grid("0:0.2:0.05") == [0.0, 0.05, 0.1, 0.15, 0.2]
    assert cli.ratio_grid("0%,10%,35%") == pytest.approx([0.0, 0.1, 0.35])
    with pytest.raises(argparse.ArgumentTypeError, match="not a ratio"):
        cli.ratio("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="STEP > 0"):
        cli.ratio_grid("0:1:0")
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        cli.duration_s("soon")
    assert cli.actuation("out-of-band") == ("out-of-band", 40.0)
    assert cli.actuation("5") == ("5s", 5.0)


def test_cli_module_imports_without_the_extra() -> None:
    """polca.cli can add the subcommands without importing numpy or matplotlib."""
    code = "import sys, polca.sim.cli; print(sorted({'numpy', 'matplotlib'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
