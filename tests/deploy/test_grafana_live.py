"""The dashboards against a real run: `polca demo` writes into InfluxDB 1.x, panels query it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.deploy.test_grafana import _dashboards, _panels, check_query, resolve_variables
from tests.tsdb import InfluxDB1Process

# Panels a healthy run must fill (faults such as lost GPUs or dropped messages need their
# own scenario: the synthetic run in test_grafana.py covers every panel).
CORE_PANELS = {
    "polca-row.json": ("power", "level", "rack"),
    "polca-gpus.json": ("power", "temperature", "clock"),
}


# The demo row has no power meter.
NOT_IN_DEMO = ("measured",)


def test_core_panels_show_a_live_demo_run(
    grafana_influxdb: InfluxDB1Process, tmp_path: Path
) -> None:
    """A 2x2-node demo written through the aggregator's sink fills the core panels."""
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
            "25",
            "--budget-w",
            "19000",
            "--influx",
            grafana_influxdb.url,
            "--influx-api",
            "v1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checked = 0
    for name, board in _dashboards().items():
        keywords = CORE_PANELS.get(name)
        if keywords is None:
            continue
        variables = resolve_variables(grafana_influxdb, board)
        assert variables.get("site") == ["demo"], variables
        for panel in _panels(board):
            title = panel.get("title", "").lower()
            if not any(word in title for word in keywords):
                continue
            for target in panel.get("targets", []):
                if "thermal_budget_w" in target["query"]:
                    continue  # rack budgets come from cooling loops and rack limits
                problems = [
                    p
                    for p in check_query(grafana_influxdb, target["query"], variables)
                    if not any(f"column {c!r}" in p for c in NOT_IN_DEMO)
                ]
                assert not problems, f"{name} / {panel['title']}: {problems}"
                checked += 1
    assert checked >= 6
