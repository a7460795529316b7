"""`polca demo`, the README's main job, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_reaches_caps_and_prints_a_summary(tmp_path: Path) -> None:
    """Embedded broker + simulated agent + controller: caps are decided, applied, summarised."""
    result = subprocess.run(
        [sys.executable, "-m", "polca", "demo", "--duration", "15"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "embedded MQTT broker on 127.0.0.1:" in out
    assert re.search(r"<- telemetry \S+:\s+\d+ W", out)
    capped = re.findall(r"<- state\s+level ([12]):.*<= \d+ MHz", out)
    assert capped, out[-3000:]
    assert "== polca demo summary ==" in out
    applied = re.search(r"cap changes applied: (\d+)", out)
    assert applied
    assert int(applied.group(1)) > 0
    assert not (tmp_path / "baseline.json").exists()
