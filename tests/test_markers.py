"""The ``integration`` marker (tests/conftest.py): the fast loop ``-m "not integration"``
leaves out exactly the tests that start real servers or processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 5), done.stdout + done.stderr  # 5: none collected
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_unit_loop_leaves_out_servers_and_processes() -> None:
    """An end-to-end module, a module on a real Mosquitto and one that runs polca commands
    are integration; a pure-logic module is not."""
    unit = _collected(
        "-m",
        "not integration",
        "tests/integration/test_agent_e2e.py",
        "tests/telemetry/test_bus.py",
        "tests/test_cli.py",
        "tests/aggregator/test_witness.py",
    )
    assert unit
    assert {line.split("::")[0] for line in unit} == {"tests/aggregator/test_witness.py"}
    integration = _collected("-m", "integration", "tests/aggregator/test_witness.py")
    assert integration == []
