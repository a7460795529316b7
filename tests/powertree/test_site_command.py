"""``polca site check`` as a process: lines and exit 1 for a bad file, the tree for a good one."""

from __future__ import annotations

import json
from pathlib import Path

from tests.powertree.test_sitefile import BAD, EXAMPLE
from tests.test_probes_cli import polca


def test_the_command_fails_with_lines_and_exit_1_never_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD, encoding="utf-8")
    done = polca("site", "check", str(bad))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert (
        done.stderr.splitlines()[0] == f"{bad}:3:9: rows.row2: row 'row2' is supplied by no domain"
    )
    ok = polca("site", "check", str(EXAMPLE))
    assert ok.returncode == 0, ok.stderr
    assert "row row2: 400,000 W" in ok.stdout


def test_the_site_controller_refuses_a_bad_tree_with_every_problem_and_exit_78(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD, encoding="utf-8")
    config = tmp_path / "site.yaml"
    config.write_text(
        f"tree_file: {bad}\nlogging: {{format: json}}\nmqtt: {{host: 127.0.0.1, port: 9}}\n",
        encoding="utf-8",
    )
    done = polca("site", "run", "--config", str(config))
    assert done.returncode == 78
    out = done.stdout + done.stderr
    assert "Traceback" not in out
    problems = [json.loads(line) for line in out.splitlines() if "site_file_problem" in line]
    assert problems
    assert problems[0]["problem"] == f"{bad}:3:9: rows.row2: row 'row2' is supplied by no domain"
    assert any('"site_fatal"' in line for line in out.splitlines())
