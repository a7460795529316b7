"""The probes an operator runs first, as real ``polca`` processes: one JSON object on
stdout and exit 0, or one line on stderr and a distinct exit code, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polca.exits import EX_CONFIG, EX_NOPERM, EX_UNAVAILABLE
from tests.services import free_port
from tests.snmpsim import SnmpSimProcess, snmpsim_agent
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import RedfishStandIn


def polca(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m polca ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "polca", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a failed probe."""
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def snmp_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnmpSimProcess]:
    yield from snmpsim_agent(tmp_path_factory.mktemp("snmpsim"))


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishStandIn]:
    standin = RedfishStandIn(
        tmp_path_factory.mktemp("redfish"),
        devices=["pdu:pdu1", "bmc:node1:controls"],
        username=USERNAME,
        password=PASSWORD,
    )
    standin.start()
    yield standin
    standin.kill()


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "pass"
    path.write_text(PASSWORD + "\n", encoding="utf-8")
    return path


def test_snmp_probe_recognises_the_vendor(snmp_agent: SnmpSimProcess) -> None:
    url = f"snmp://{snmp_agent.host}:{snmp_agent.port}"
    ok = polca("meter", "probe", url, "--community", "apc-phases")
    assert ok.returncode == 0, ok.stderr
    answer = json.loads(ok.stdout)
    assert answer["power_w"] == 4800.0
    assert answer["vendor"] == "apc"
    assert answer["source"] == "phase power (3 phases)"
    assert answer["fallbacks"] == ["device power: -1 (not supported)"]
    forced = polca("meter", "probe", url, "--community", "apc", "--profile", "eaton")
    assert forced.returncode != 0  # the profile overrides the vendor: not an Eaton's OIDs
    one_line(forced)
    silent = polca("meter", "probe", url, "--community", "no-such-community", "--timeout", "0.5")
    assert silent.returncode == EX_UNAVAILABLE
    one_line(silent)


def test_redfish_meter_probe_walks_to_the_pdus_mains(
    devices: RedfishStandIn, password_file: Path
) -> None:
    devices.set_state("pdu1", power_w=7200.0)
    ok = polca(
        "meter", "probe", devices.url, "--username", USERNAME,
        "--password-file", str(password_file),
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    answer = json.loads(ok.stdout)
    assert answer["power_w"] == pytest.approx(7200.0)
    assert "Mains" in json.dumps(answer["resources"])
    refused = polca("meter", "probe", devices.url, "--username", "intruder",
                    "--password-file", str(password_file))  # fmt: skip
    assert refused.returncode == EX_NOPERM
    one_line(refused)


def test_bmc_probe_cap_and_restore(devices: RedfishStandIn, password_file: Path) -> None:
    auth = ["--username", USERNAME, "--password-file", str(password_file)]
    probe = polca("bmc", "probe", devices.url, *auth)
    assert probe.returncode == 0, probe.stderr
    reading = json.loads(probe.stdout)
    assert set(reading) == {
        "power_w", "limit_w", "limit_min_w", "limit_max_w", "control", "units", "controls",
    }  # fmt: skip
    assert reading["control"].endswith("/Controls/NodePower")
    cap = polca("bmc", "cap", devices.url, "--watts", "700", *auth)
    assert cap.returncode == 0, cap.stderr
    assert json.loads(cap.stdout) == {"limit_w": 700.0, "verified": True}
    outside = polca("bmc", "cap", devices.url, "--watts", "99999", *auth)
    assert outside.returncode == EX_CONFIG
    one_line(outside)
    restore = polca("bmc", "restore", devices.url, *auth)
    assert restore.returncode == 0, restore.stderr
    assert json.loads(restore.stdout) == {"limit_w": reading["limit_max_w"], "verified": True}
    gone = polca("bmc", "probe", f"http://127.0.0.1:{free_port()}", *auth)
    assert gone.returncode == EX_UNAVAILABLE
    one_line(gone)
