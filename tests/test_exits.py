"""How a process ends: the exit-code policy, and the exit record (crash streaks, kills, clean
stops, a hostile file)."""

from __future__ import annotations

import io
import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from polca.errors import ConfigError, PolicyError, TransportError
from polca.exits import (
    EX_CONFIG,
    EX_FAILURE,
    EX_INTERRUPTED,
    EXITS_FILE,
    KILLED,
    ExitRecord,
    Streak,
    describe_failure,
    exit_code,
    run_process,
)


def test_the_same_failure_in_a_row_makes_a_streak(tmp_path: Path) -> None:
    """Three runs ended by one failure give a streak of three; another failure resets it."""
    for run in range(3):
        record = ExitRecord(tmp_path)
        streak = record.start()
        assert streak == (Streak("RuntimeError: boom", run) if run else None)
        record.crashed("RuntimeError: boom")
    again = ExitRecord(tmp_path)
    assert again.start() == Streak("RuntimeError: boom", 3)
    again.crashed("OSError: disk")
    assert ExitRecord(tmp_path).start() == Streak("OSError: disk", 1)


def test_a_run_that_never_said_how_it_ended_was_killed(tmp_path: Path) -> None:
    """A run still marked running at the next start is recorded as killed."""
    ExitRecord(tmp_path).start()  # then SIGKILL: nothing more is written
    assert ExitRecord(tmp_path).start() == Streak(KILLED, 1)


def test_a_clean_stop_clears_the_streak(tmp_path: Path) -> None:
    """After a clean stop the next start reports nothing."""
    record = ExitRecord(tmp_path)
    record.start()
    record.crashed("X: y")
    record = ExitRecord(tmp_path)
    record.start()
    record.stopped()
    assert ExitRecord(tmp_path).start() is None


def test_a_hostile_record_is_replaced_not_fatal(tmp_path: Path) -> None:
    """Garbage, wrong types, deep nesting and a huge file are logged and replaced."""
    for text in ("{not json", '{"running": 1, "exits": []}', "[" * 100_000, "x" * 100_000):
        (tmp_path / EXITS_FILE).write_text(text, encoding="utf-8")
        with capture_logs() as logs:
            assert ExitRecord(tmp_path).start() is None
        assert [e["event"] for e in logs] == ["exit_record_unreadable"]
        assert json.loads((tmp_path / EXITS_FILE).read_text(encoding="utf-8"))["running"]


def test_an_unwritable_state_dir_is_logged_not_fatal(tmp_path: Path) -> None:
    """A record that cannot be saved is a warning; the daemon carries on."""
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    with capture_logs() as logs:
        assert ExitRecord(blocker / "state").start() is None
    assert "exit_record_not_saved" in [e["event"] for e in logs]


def test_failures_are_described_by_their_first_leaf() -> None:
    """An ExceptionGroup is described by its first leaf, on one line."""
    group = ExceptionGroup("tasks", [ValueError("bad\nsecond line"), OSError("x")])
    assert describe_failure(group) == "ValueError: bad"


def _ended(
    exc: BaseException, daemon: str = "aggregator"
) -> tuple[int, list[MutableMapping[str, Any]]]:
    with capture_logs() as logs:
        code = exit_code(exc, structlog.get_logger(), daemon=daemon)
    return code, logs


def test_a_fatal_error_exits_78_and_names_the_daemon() -> None:
    """A configuration problem or a bad policy is EX_CONFIG (no restart), logged as fatal."""
    for error in (ConfigError("no such file"), PolicyError("level 3 has no caps")):
        code, logs = _ended(error)
        assert code == EX_CONFIG
        assert [(e["event"], e["daemon"], e["kind"]) for e in logs] == [
            ("aggregator_fatal", "aggregator", type(error).__name__)
        ]


def test_other_failures_exit_1_and_a_crash_carries_its_traceback() -> None:
    """A polca error is ``failed``; anything else is ``crashed`` with exc_info."""
    code, logs = _ended(TransportError("broker gone"), daemon="cdu")
    assert code == EX_FAILURE
    assert [e["event"] for e in logs] == ["cdu_failed"]
    assert "exc_info" not in logs[0]
    bug = ZeroDivisionError("division by zero")
    code, logs = _ended(bug, daemon="demo")
    assert code == EX_FAILURE
    assert logs[0]["event"] == "demo_crashed"
    assert logs[0]["exc_info"] is bug


def test_a_group_logs_every_cause_and_the_fatal_one_decides_the_code() -> None:
    """Each leaf of a task group is one line; one fatal leaf makes the exit 78."""
    group = ExceptionGroup(
        "tasks", [RuntimeError("a"), ExceptionGroup("inner", [ConfigError("b")])]
    )
    code, logs = _ended(group, daemon="agent")
    assert code == EX_CONFIG
    assert [e["event"] for e in logs] == ["agent_crashed", "agent_fatal"]


def test_ctrl_c_alone_is_130_and_logs_nothing() -> None:
    """A KeyboardInterrupt is the operator's stop, not a failure."""
    code, logs = _ended(BaseExceptionGroup("stop", [KeyboardInterrupt()]))
    assert (code, logs) == (EX_INTERRUPTED, [])
    code, _ = _ended(BaseExceptionGroup("both", [KeyboardInterrupt(), RuntimeError("x")]))
    assert code == EX_FAILURE


class _Logging:
    level = "info"
    format = "json"


class _Settings:
    logging = _Logging()


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_process_whose_settings_are_invalid_says_so_once_and_exits_78() -> None:
    """A bad configuration: one ``config_invalid`` line naming the problem, ``EX_CONFIG``,
    and the process's body never runs."""
    out, ran = io.StringIO(), []

    def load() -> _Settings:
        msg = "mqtt.port: must be at most 65535"
        raise ConfigError(msg)

    async def body(_: _Settings) -> None:
        ran.append(True)

    assert run_process("meter", load, body, stream=out) == EX_CONFIG
    assert ran == []
    (line,) = _lines(out)
    assert (line["event"], line["error"]) == ("config_invalid", "mqtt.port: must be at most 65535")


@pytest.mark.parametrize(
    ("outcome", "code", "event"),
    [
        (None, 0, None),
        (3, 3, None),  # a one-shot round's own code
        (TransportError("broker gone"), EX_FAILURE, "agent_failed"),
        (PolicyError("policy p.yaml is invalid"), EX_CONFIG, "agent_fatal"),
        (RuntimeError("bug"), EX_FAILURE, "agent_crashed"),
        (KeyboardInterrupt(), EX_INTERRUPTED, None),
    ],
)
def test_a_process_ends_with_its_bodys_code_or_what_ended_it(
    outcome: BaseException | int | None, code: int, event: str | None
) -> None:
    """The body runs in a fresh loop with the logging its settings ask for; what ends it
    is ``exit_code``'s to log (one critical line) and to code."""
    out = io.StringIO()

    async def body(_: _Settings) -> int | None:
        structlog.get_logger().info("running")
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert run_process("agent", _Settings, body, stream=out) == code
    lines = _lines(out)
    assert lines[0]["event"] == "running"
    assert [line["event"] for line in lines[1:]] == ([event] if event else [])
