"""``polca bmc probe|cap|restore`` against the stand-in: one JSON object, or one line and a code.

The commands run in-process through ``polca.bmc.cli.main`` with arguments parsed by a
parser built with its ``add_parsers`` (until ``polca.cli`` wires ``bmc`` in).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from polca.bmc import cli
from polca.exits import (
    EX_CONFIG,
    EX_DATAERR,
    EX_NOPERM,
    EX_PROTOCOL,
    EX_UNAVAILABLE,
    EX_USAGE,
)
from tests.services import free_port
from tests.standins.fixtures import PASSWORD, USERNAME, TlsFiles
from tests.standins.process import RedfishStandIn


def parser() -> argparse.ArgumentParser:
    """A ``polca``-like parser with only the ``bmc`` commands."""
    p = argparse.ArgumentParser(prog="polca")
    sub = p.add_subparsers(dest="command", required=True)
    cli.add_parsers(sub)
    return p


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    """The stand-in's password in a file."""
    path = tmp_path / "bmc-password"
    path.write_text(PASSWORD + "\n", encoding="utf-8")
    return path


def run(
    capsys: pytest.CaptureFixture[str], *argv: str, login: Path | None = None
) -> tuple[int, Any, list[str]]:
    """Run ``polca bmc ARGV``; the exit code, the parsed stdout (or None) and stderr lines."""
    args = list(argv)
    if login is not None:
        args += ["--username", USERNAME, "--password-file", str(login)]
    code = cli.main(parser().parse_args(["bmc", *args]))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    stdout_lines = out.splitlines()
    assert len(stdout_lines) <= 1
    return code, json.loads(out) if out else None, err.splitlines()


def test_probe(
    bmc_standin: RedfishStandIn, password_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """probe prints the reading as one JSON object and exits 0."""
    code, answer, err = run(capsys, "probe", bmc_standin.url, login=password_file)
    assert (code, err) == (0, [])
    assert answer == {
        "power_w": 900.0,
        "limit_w": 1200.0,
        "limit_min_w": 300.0,
        "limit_max_w": 1500.0,
        "control": answer["control"],
        "units": "W",
        "controls": answer["controls"],
    }
    assert answer["control"].startswith("/redfish/v1/Chassis/node1/")
    # The power controls seen on the node's chassis (none in the legacy shape).
    assert [c["chosen"] for c in answer["controls"]] == (
        [True] if answer["control"].endswith("NodePower") else []
    )


def test_cap_and_restore(
    bmc_standin: RedfishStandIn, password_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cap and restore print the limit read back and whether it was verified."""
    code, answer, _ = run(capsys, "cap", bmc_standin.url, "--watts", "750", login=password_file)
    assert (code, answer) == (0, {"limit_w": 750.0, "verified": True})
    _, probe, _ = run(capsys, "probe", bmc_standin.url, login=password_file)
    assert (probe["limit_w"], probe["power_w"]) == (750.0, 750.0)
    code, answer, _ = run(capsys, "restore", bmc_standin.url, login=password_file)
    assert (code, answer) == (0, {"limit_w": 1500.0, "verified": True})


def test_cap_outside_the_range(
    bmc_standin: RedfishStandIn, password_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cap outside the allowable range exits 78 with one line; nothing is written."""
    code, answer, err = run(capsys, "cap", bmc_standin.url, "--watts", "5000", login=password_file)
    assert (code, answer, len(err)) == (EX_CONFIG, None, 1)
    assert "outside the allowable 300..1500 W" in err[0]
    assert not [r for r in bmc_standin.requests() if r["method"] == "PATCH"]


def test_liar_exits_with_protocol_error(
    bmc_standin: RedfishStandIn, password_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A BMC that keeps another limit: the JSON says verified false, the code is 76."""
    bmc_standin.fault("liar")
    code, answer, err = run(capsys, "cap", bmc_standin.url, "--watts", "800", login=password_file)
    assert (code, answer, len(err)) == (EX_PROTOCOL, {"limit_w": 1200.0, "verified": False}, 1)


def test_hostile_values_exit_with_data_error(
    bmc_standin: RedfishStandIn, password_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Numbers as strings are an unusable answer: code 65, one line naming the reason."""
    bmc_standin.fault("wrong_types", path_prefix="/redfish/v1/Chassis/node1/")
    code, answer, err = run(capsys, "probe", bmc_standin.url, login=password_file)
    assert (code, answer, len(err)) == (EX_DATAERR, None, 1)
    assert "(type)" in err[0]


def test_wrong_password(
    bmc_standin: RedfishStandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused credentials exit 77."""
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n", encoding="utf-8")
    code, answer, err = run(capsys, "probe", bmc_standin.url, login=wrong)
    assert (code, answer, len(err)) == (EX_NOPERM, None, 1)


def test_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listening exits 69 with one line on stderr and nothing on stdout."""
    url = f"http://127.0.0.1:{free_port()}"
    code, answer, err = run(capsys, "probe", url, "--timeout", "1")
    assert (code, answer, len(err)) == (EX_UNAVAILABLE, None, 1)
    assert err[0].startswith("BMC unreachable: ")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["probe", "ftp://127.0.0.1"], EX_CONFIG),
        (["probe", "https://127.0.0.1/redfish/v1/x"], EX_CONFIG),
        (["probe", "http://127.0.0.1:1", "--timeout", "0"], EX_CONFIG),
        (["cap", "http://127.0.0.1:1", "--watts", "-5"], EX_USAGE),
        (["cap", "http://127.0.0.1:1", "--watts", "nan"], EX_USAGE),
        (["probe", "http://127.0.0.1:1", "--username", "u"], EX_CONFIG),
    ],
)
def test_bad_arguments(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    expected: int,
) -> None:
    """A bad URL, option or watts value (or a user without password) is one line and a code."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    code, answer, err = run(capsys, *argv)
    assert (code, answer, len(err)) == (expected, None, 1)


def test_https_with_ca_file_and_insecure(
    standin_factory: Callable[..., RedfishStandIn],
    tls_files: TlsFiles,
    password_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """https:// is verified with --ca-file; without it the BMC is unreachable (69)."""
    standin = standin_factory(
        devices=["bmc:node1"],
        username=USERNAME,
        password=PASSWORD,
        tls=(tls_files.cert, tls_files.key),
    )
    code, answer, _ = run(
        capsys, "probe", standin.url, "--ca-file", str(tls_files.ca), login=password_file
    )
    assert (code, answer["limit_w"]) == (0, 1200.0)
    code, answer, err = run(capsys, "probe", standin.url, login=password_file)
    assert (code, answer, len(err)) == (EX_UNAVAILABLE, None, 1)
    assert "ca_file" in err[0]
    code, answer, _ = run(capsys, "probe", standin.url, "--insecure", login=password_file)
    assert (code, answer["power_w"]) == (0, 900.0)
