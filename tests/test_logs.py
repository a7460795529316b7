"""Logging: JSON lines off a terminal (journald), readable console on one."""

from __future__ import annotations

import io
import json

import structlog

from polca import logs


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_with_stable_event_names_and_no_locals() -> None:
    """Off a TTY each line is JSON with event, level, timestamp; tracebacks omit locals."""
    out = io.StringIO()
    logs.configure(fmt="auto", stream=out, journald=False)
    log = structlog.get_logger().bind(node="n1")
    log.info("cap_applied", gpu=3, new_mw=300_000)
    secret = "hunter2"  # noqa: S105 - must never reach the log through locals
    msg = "boom"
    try:
        raise ValueError(msg)  # noqa: TRY301 - a traceback to render
    except ValueError:
        log.exception("task_failed", task="sampler")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "cap_applied"
    assert lines[0]["gpu"] == 3
    assert lines[0]["node"] == "n1"
    assert lines[0]["level"] == "info"
    assert "timestamp" in lines[0]
    assert lines[1]["exception"][0]["exc_type"] == "ValueError"
    assert secret not in out.getvalue()
    assert all("locals" not in frame for frame in lines[1]["exception"][0]["frames"])


def test_journald_priority_prefix() -> None:
    """Under journald each line starts with its syslog priority, so -p warning filters."""
    out = io.StringIO()
    logs.configure(fmt="json", stream=out, journald=True)
    structlog.get_logger().warning("gpu_lost", gpu=1)
    assert out.getvalue().startswith("<4>{")


def test_console_on_a_terminal_and_level_filtering() -> None:
    """On a TTY the console renderer is used; debug is filtered at info."""
    out = _Tty()
    logs.configure(fmt="auto", stream=out, level="info")
    structlog.get_logger().debug("hidden_event")
    structlog.get_logger().info("shown_event", gpu=2)
    text = out.getvalue()
    assert "shown_event" in text
    assert "hidden_event" not in text
    assert not text.lstrip().startswith("{")
