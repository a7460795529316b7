"""`polca demo`, the README's main job, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_row_reaches_caps_and_prints_a_summary(tmp_path: Path) -> None:
    """Embedded broker, aggregator, trace-driven simulated nodes: levels, caps, a summary."""
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
            "22000",
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
    assert float(peak.group(2)) >= float(peak.group(1))  # caps only ever lower the peak
    servers = re.search(r"servers\s+: 4 nodes on a budget that holds (\d+) at this load", out)
    assert servers, out[-1500:]
    given = re.search(r"clock given up\s+: high ([-+][\d.]+)%, low ([-+][\d.]+)%", out)
    assert given, out[-1500:]
    assert float(given.group(2)) <= float(given.group(1)) <= 0.5  # low gives up the most
    cost = re.search(r"latency cost\s+: high ([-+][\d.]+)%, low ([-+][\d.]+)% \(the planner", out)
    assert cost, out[-1500:]
    assert float(cost.group(2)) >= float(cost.group(1)) >= -0.5  # low pays the most
    assert float(cost.group(2)) > 0.0  # the row was capped, so low-priority work slowed
