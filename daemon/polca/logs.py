"""structlog configuration, done once by the command line entry point.

JSON lines on stdout when stdout is not a terminal (journald and containers collect them),
a readable console renderer on a terminal. Each JSON line starts with a syslog priority
prefix (``<6>`` info, ``<4>`` warning, ...) only when ``journald=True``, so that
``journalctl -p warning`` filters by level. Library loggers (paho, aiomqtt, amqtt) go
through the standard ``logging`` module at WARNING and up.

Nothing here runs at import time.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LEVELS = tuple(_LEVELS)
"""The levels a process logs at (``logging.level``, ``--log-level``)."""
FORMATS = ("auto", "json", "console")
"""How lines are written (``logging.format``, ``--log-format``): ``auto`` is JSON unless
the stream is a terminal."""


def add_options(parser: Any, *, level: str | None = None, fmt: bool = True) -> None:
    """Add ``--log-level`` (default ``level``; None: the settings') and, with ``fmt``,
    ``--log-format`` to a command's ``argparse`` parser."""
    parser.add_argument("--log-level", choices=LEVELS, default=level)
    if fmt:
        parser.add_argument("--log-format", choices=FORMATS, default=None)


_SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def _syslog_prefix(_logger: Any, method: str, event: str) -> str:
    """Prefix a rendered line with ``<N>`` so journald records its priority."""
    return f"<{_SYSLOG_PRIORITY.get(method, 6)}>{event}"


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def configure(
    *,
    level: str = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: TextIO | None = None,
    journald: bool | None = None,
) -> None:
    """Configure structlog (and stdlib logging for libraries) for this process."""
    out = stream or sys.stdout
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    if journald is None:
        import os  # noqa: PLC0415 - only for this check

        journald = use_json and "JOURNAL_STREAM" in os.environ
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Any]
    if use_json:
        # Tracebacks as data, without local variables: they bloat journald and could carry
        # secrets.
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        renderer = [tracebacks, structlog.processors.JSONRenderer()]
        if journald:
            renderer.append(_syslog_prefix)
    else:
        renderer = [
            structlog.dev.ConsoleRenderer(
                colors=out.isatty(),
                exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False)
                if _has_rich()
                else structlog.dev.plain_traceback,
            )
        ]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    for noisy in ("amqtt", "transitions", "paho", "pymodbus"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
