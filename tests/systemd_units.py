"""Checking systemd unit files: a parser, the comment rules and ``systemd-analyze`` runs.

``tests/test_systemd_unit.py`` (the agent's unit) and ``tests/test_aggregator_unit.py`` (the
aggregator's) check their units the same way: parsed directives, a comment above every
directive, and systemd's own ``verify`` and offline ``security`` review. This module is that
once. ``systemd-analyze`` must be installed (Debian package ``systemd``); the helpers fail
the test, never skip, without it (only an old systemd without an offline security review
skips that one check).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

Unit = dict[str, dict[str, list[str]]]
"""Sections -> key -> every value in order."""

_DIRECTIVE_RE = re.compile(r"^[A-Za-z]+=")

# Lines systemd-analyze may print about the container rather than the unit.
CONTAINER_NOISE = re.compile(r"Failed to read \$container|PR_SET_MM_|Cannot stat .*/transient")


def parse_unit(text: str) -> Unit:
    """Sections -> key -> every value in order (unit files repeat keys, e.g. DeviceAllow=)."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"line {number}: continuation lines are not parsed"
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"line {number}: directive outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"line {number}: not a KEY=value line: {raw!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def uncommented_directives(text: str) -> list[str]:
    """``"NUMBER: line"`` for each KEY=value line not directly below a comment line."""
    lines = text.splitlines()
    return [
        f"{number}: {line}"
        for number, (previous, line) in enumerate(zip(["", *lines], lines, strict=False), 1)
        if _DIRECTIVE_RE.match(line) and not previous.lstrip().startswith("#")
    ]


def directive_count(text: str) -> int:
    """How many KEY=value lines the unit has."""
    return sum(1 for line in text.splitlines() if _DIRECTIVE_RE.match(line))


def trailing_comments(text: str) -> list[str]:
    """Directive lines with a `` #`` in the value (systemd would keep it as part of it)."""
    return [line for line in text.splitlines() if "=" in line and " #" in line.split("=", 1)[1]]


def systemd_analyze() -> str:
    """The path of ``systemd-analyze``; fails the test when it is not installed."""
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail(
            "systemd-analyze not found: install it with `apt-get install systemd` "
            "(the unit file is checked by systemd itself)"
        )
    return path


def run_analyze(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a ``systemd-analyze`` command line; its output as text."""
    # Warnings and errors only, no colours, on the console; no man page lookups.
    env = {
        **os.environ,
        "SYSTEMD_LOG_LEVEL": "warning",
        "SYSTEMD_LOG_COLOR": "0",
        "SYSTEMD_LOG_TARGET": "console",
        "SYSTEMD_PAGER": "",
    }
    return subprocess.run(
        argv, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def verifiable_copy(directory: Path, name: str, text: str) -> Path:
    """The unit as ``directory/name`` with ExecStart= pointing at an existing binary.

    ``systemd-analyze verify`` checks that the binary exists.
    """
    rewritten, count = re.subn(r"(?m)^ExecStart=\S+", "ExecStart=/bin/true", text)
    assert count == 1
    path = directory / name
    path.write_text(rewritten, encoding="utf-8")
    return path


def verify(
    directory: Path, name: str, text: str, *, host_noise: Iterable[re.Pattern[str]]
) -> tuple[int, list[str]]:
    """``systemd-analyze verify``'s exit status and the lines it printed about the unit.

    The unit ``text`` is verified as ``directory/name`` (see ``verifiable_copy``); lines
    matching a ``host_noise`` pattern are about the host, not the unit, and left out.
    """
    analyze = systemd_analyze()
    path = verifiable_copy(directory, name, text)
    result = run_analyze(
        [analyze, "verify", "--man=no", "--recursive-errors=no", path.name], directory
    )
    noise = list(host_noise)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return result.returncode, [line for line in lines if not any(p.search(line) for p in noise)]


def exposure(path: Path) -> float:
    """``systemd-analyze security --offline``'s overall exposure score of a unit file.

    0 is locked down, 10 unprotected. Skips the test on a systemd older than 250, which
    has no offline review.
    """
    analyze = systemd_analyze()
    help_text = run_analyze([analyze, "security", "--help"], path.parent).stdout
    if "--offline" not in help_text:
        pytest.skip("this systemd-analyze has no offline security review (needs systemd >= 250)")
    result = run_analyze([analyze, "security", "--offline=true", str(path)], path.parent)
    match = re.search(
        rf"Overall exposure level for {re.escape(path.name)}: ([0-9.]+)", result.stdout
    )
    assert match is not None, result.stdout + result.stderr
    return float(match.group(1))


def assert_documented(text: str, *, at_least: int) -> None:
    """A comment above every KEY=value line of a unit, none after one, and at least
    ``at_least`` directives (a unit that lost its sandbox has fewer)."""
    assert uncommented_directives(text) == []
    assert trailing_comments(text) == []
    assert directive_count(text) >= at_least


def assert_verified(
    directory: Path,
    name: str,
    text: str,
    *,
    misspelt: tuple[str, str],
    host_noise: Iterable[re.Pattern[str]],
) -> None:
    """``systemd-analyze verify`` is clean on the unit ``text``, and reports the key of
    ``misspelt`` (good, bad) when the good directive is written the bad way."""
    noise = list(host_noise)
    (directory / "good").mkdir()
    (directory / "bad").mkdir()
    assert verify(directory / "good", name, text, host_noise=noise) == (0, [])
    good, bad = misspelt
    assert good in text
    _, problems = verify(directory / "bad", name, text.replace(good, bad), host_noise=noise)
    assert bad.split("=", 1)[0] in "\n".join(problems)
