"""The polca command line, run as a user would (a subprocess of the installed package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _polca(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polca", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=ROOT,
    )


def test_policy_check_passes_shipped_policies() -> None:
    """Every policy shipped in policies/ is valid according to the command line."""
    files = sorted(str(p) for p in (ROOT / "policies").glob("*.yaml"))
    assert files
    result = _polca("policy", "check", *files)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok") == len(files)


def test_policy_check_reports_file_line_col(tmp_path: Path) -> None:
    """A broken policy exits non-zero with one FILE:LINE:COL line per problem."""
    bad = tmp_path / "bad.yaml"
    text = (ROOT / "policies" / "polca-a100.yaml").read_text(encoding="utf-8")
    bad.write_text(text.replace("threshold_pct: 89", "threshold_pct: 70", 1), encoding="utf-8")
    result = _polca("policy", "check", str(bad))
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines
    assert all(line.startswith(f"{bad}:") for line in lines)
    file_, line, col = lines[0].split(":")[:3]
    assert int(line) > 1
    assert int(col) >= 1
    assert file_ == str(bad)


def test_gpu_probe_on_the_simulated_backend() -> None:
    """`polca gpu probe` lists GPUs, capabilities, a reading and write access."""
    result = _polca("gpu", "probe", "--backend", "simulated")
    assert result.returncode == 0, result.stderr
    assert "8 GPU(s)" in result.stdout
    assert "write access: yes" in result.stdout


def test_agent_with_bad_config_exits_78(tmp_path: Path) -> None:
    """An invalid configuration is a fatal error with the EX_CONFIG status."""
    config = tmp_path / "agent.yaml"
    config.write_text("mqtt:\n  port: -1\n", encoding="utf-8")
    result = _polca("agent", "--config", str(config), "--log-format", "json")
    assert result.returncode == 78
    assert "mqtt.port" in result.stdout + result.stderr


def test_agent_with_invalid_policy_refuses_to_start(tmp_path: Path) -> None:
    """No valid policy at start-up: exit 78 naming the problem, nothing touched."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("schema_version: 1\nnmae: x\n", encoding="utf-8")
    result = _polca(
        "agent",
        "--backend",
        "simulated",
        "--policy",
        str(policy),
        "--log-format",
        "json",
        "--broker",
        "127.0.0.1:1",
    )
    assert result.returncode == 78
    assert f"{policy}:" in result.stdout


def test_config_show_refuses_a_secret_in_yaml_without_a_traceback(tmp_path: Path) -> None:
    """A password in the YAML (any case) is one clear line on stderr and exit 78."""
    config = tmp_path / "agent.yaml"
    config.write_text("MQTT:\n  PassWord: hunter2\n", encoding="utf-8")
    result = _polca("config", "show", "--config", str(config))
    assert result.returncode == 78
    assert "Traceback" not in result.stderr
    assert "is not allowed in the configuration file" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout


def test_a_daemon_with_a_bad_broker_option_says_so_in_one_line_and_exits_78() -> None:
    """``--broker host:notaport``: each daemon's start-up (``exits.run_process``) logs one
    ``config_invalid`` line naming the option and exits 78, no traceback."""
    for daemon in ("agent", "aggregator"):
        result = _polca(daemon, "--broker", "mq.example:mqtts", "--log-format", "json")
        assert result.returncode == 78, (daemon, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr
        (line,) = [ln for ln in result.stdout.splitlines() if "config_invalid" in ln]
        assert "--broker 'mq.example:mqtts'" in line
