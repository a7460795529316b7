"""How a polca process ends: its exit code, the line it logs, and the record of its runs.

Exit codes, for every command and daemon (``exit_code`` chooses them): 0 success,
``EX_FAILURE`` (1) an unexpected failure, ``EX_USAGE`` (2) a usage error (argparse),
``EX_DATAERR`` (65) a device answered a probe with nothing usable, ``EX_UNAVAILABLE``
(69) a one-shot command could not reach the broker or device, ``EX_PROTOCOL`` (76) a
device took a write but reports another value, ``EX_NOPERM`` (77)
the broker refused its credentials, ``EX_CONFIG`` (78) a fatal configuration or privilege
problem whose message says how to fix it (the systemd units do not restart on 78),
``EX_INTERRUPTED`` (130) stopped by Ctrl-C. The process that ended logs one critical line
per cause, named after it: ``{daemon}_fatal`` (78), ``{daemon}_failed`` (a polca error) or
``{daemon}_crashed`` (anything else, with its traceback), each with ``daemon=``.

The record of runs tells a crash loop from one crash.

systemd restarts a failed daemon (``Restart=on-failure``); a failure that repeats on every
start (a poisoned input, a broken disk) would otherwise spin quietly. Each daemon keeps
``<state_dir>/exits.json``: whether a run is in progress and the failures that ended the
last runs. At start-up, a run still marked in progress ended without saying how (SIGKILL,
out of memory, power loss) and is recorded as ``killed``; the same failure ending the last
N runs in a row is a crash loop, which the daemon reports (log, systemd ``STATUS=``, its
MQTT status) instead of starting as if nothing happened. A clean stop clears the record.

The file is the daemon's own, but it is read as hostile anyway: anything unreadable or
malformed is logged and replaced, never fatal. Writes are atomic (temporary file, rename).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TextIO, TypeVar

import structlog

from polca import logs
from polca.errors import (
    FatalError,
    PolcaError,
    PolicyError,
    ReadingRejectedError,
    TransportAuthError,
    TransportError,
)

EXITS_FILE = "exits.json"
KILLED = "killed: the previous run ended without a clean stop (SIGKILL, OOM, power loss)"
_KEEP = 16
_FAILURE_CHARS = 200
_MAX_FILE_BYTES = 64 * 1024

EX_FAILURE: Final = 1
EX_USAGE: Final = 2
EX_DATAERR: Final = 65
EX_UNAVAILABLE: Final = 69
EX_PROTOCOL: Final = 76
"""sysexits: a service the command needs (the MQTT broker) cannot be reached."""
EX_NOPERM: Final = 77
"""sysexits: the broker refused the credentials."""
EX_CONFIG: Final = 78
"""sysexits: a configuration (or privilege) problem; systemd does not restart on it."""
EX_INTERRUPTED: Final = 130
"""128 + SIGINT: stopped from the terminal."""

__all__ = [
    "EX_CONFIG",
    "EX_DATAERR",
    "EX_FAILURE",
    "EX_INTERRUPTED",
    "EX_NOPERM",
    "EX_PROTOCOL",
    "EX_UNAVAILABLE",
    "EX_USAGE",
    "KILLED",
    "ExitRecord",
    "Streak",
    "describe_failure",
    "exit_code",
    "leaves",
    "one_shot_code",
    "run_process",
]


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, flattened (``[exc]`` for a plain one)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


class _Logging(Protocol):
    @property
    def level(self) -> Any: ...
    @property
    def format(self) -> Any: ...


class _Logged(Protocol):
    @property
    def logging(self) -> _Logging: ...


SettingsT = TypeVar("SettingsT", bound=_Logged)


def run_process(
    daemon: str,
    load: Callable[[], SettingsT],
    main: Callable[[SettingsT], Coroutine[Any, Any, int | None]],
    *,
    stream: TextIO | None = None,
) -> int:
    """Start and run one polca process to its end; its exit code.

    The one start-up of every daemon and service (``polca agent``, ``aggregator``,
    ``meter``, ``cdu``): ``load`` its settings (a ``FatalError``: one ``config_invalid``
    line, ``EX_CONFIG``), configure logging as they say (to ``stream``, default stdout),
    then run ``main`` in a fresh event loop; what ends it is ``exit_code``'s to log and
    code. ``main`` returns its own code (a one-shot round) or None (0).
    """
    try:
        settings = load()
    except FatalError as exc:
        logs.configure(stream=stream)
        structlog.get_logger().error("config_invalid", error=str(exc))
        return EX_CONFIG
    logs.configure(level=settings.logging.level, fmt=settings.logging.format, stream=stream)
    log = structlog.get_logger()
    try:
        code = asyncio.run(main(settings))
    except (Exception, KeyboardInterrupt) as exc:
        return exit_code(exc, log, daemon=daemon)
    return code or 0


def exit_code(exc: BaseException, log: Any, *, daemon: str) -> int:
    """Log what ended ``daemon`` (one critical line per cause) and choose its exit code.

    A fatal error (``FatalError``, a bad policy) is ``EX_CONFIG``: restarting cannot
    help. Any other failure is ``EX_FAILURE``; Ctrl-C alone is ``EX_INTERRUPTED``.
    """
    causes = leaves(exc)
    if all(isinstance(leaf, KeyboardInterrupt) for leaf in causes):
        return EX_INTERRUPTED
    code = EX_FAILURE
    for leaf in causes:
        if isinstance(leaf, KeyboardInterrupt):
            continue
        fatal = isinstance(leaf, FatalError | PolicyError)
        how = "fatal" if fatal else "failed" if isinstance(leaf, PolcaError) else "crashed"
        event = f"{daemon}_{how}"
        fields: dict[str, Any] = {"daemon": daemon, "error": str(leaf), "kind": type(leaf).__name__}
        if how == "crashed":
            fields["exc_info"] = leaf
        log.critical(event, **fields)
        if fatal:
            code = EX_CONFIG
    return code


def one_shot_code(exc: BaseException) -> int:
    """The exit code of a one-shot command (a probe) that failed with ``exc``.

    Credentials refused: ``EX_NOPERM``; the device or broker unreachable:
    ``EX_UNAVAILABLE``; it answered with nothing usable (``ReadingRejectedError``):
    ``EX_DATAERR``; a configuration problem: ``EX_CONFIG``; anything else ``EX_FAILURE``.
    """
    if isinstance(exc, TransportAuthError):
        return EX_NOPERM
    if isinstance(exc, TransportError):
        return EX_UNAVAILABLE
    if isinstance(exc, ReadingRejectedError):
        return EX_DATAERR
    if isinstance(exc, FatalError):
        return EX_CONFIG
    return EX_FAILURE


def describe_failure(exc: BaseException) -> str:
    """A short, stable description of what ended a run: the first leaf's type and message."""
    exc = leaves(exc)[0]
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:_FAILURE_CHARS]


@dataclass(frozen=True, slots=True)
class Streak:
    """The failure that ended the most recent runs, and how many runs in a row."""

    failure: str
    count: int

    @property
    def text(self) -> str:
        """One line for systemd's ``STATUS=`` and the MQTT status ``reason`` (<= 256)."""
        return f"crash loop: {self.failure} ({self.count} runs)"[:256]


class ExitRecord:
    """The exits file of one daemon (construction does no I/O)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        logger: Any = None,
    ) -> None:
        """Keep the record in ``state_dir``; log through ``logger``."""
        self.path = state_dir / EXITS_FILE
        self._clock_ns = clock_ns
        self._log: Any = logger if logger is not None else structlog.get_logger()
        self._exits: list[dict[str, object]] = []

    def start_reporting(self, *, crash_loop_after: int) -> Streak | None:
        """Note that a run begins and log how the last ones ended; the crash loop, if any.

        A streak of ``crash_loop_after`` runs or more is a crash loop: logged as an error
        (``crash_loop``) and returned for the daemon to show in its status. A shorter one
        is a warning (``previous_run_failed``).
        """
        streak = self.start()
        if streak is None:
            return None
        if streak.count < crash_loop_after:
            self._log.warning("previous_run_failed", failure=streak.failure, runs=streak.count)
            return None
        self._log.error(
            "crash_loop",
            failure=streak.failure,
            runs=streak.count,
            hint="the same failure ended the last runs; see the log lines before each",
        )
        return streak

    def start(self) -> Streak | None:
        """Note that a run begins; return the streak of failures that ended the last runs."""
        running, exits = self._read()
        if running:
            exits.append({"ts_ns": self._now_ns(), "failure": KILLED})
        self._exits = exits[-_KEEP:]
        self._write(running=True)
        return self.streak()

    def streak(self) -> Streak | None:
        """The failure that ended the latest runs and its count, or None after a clean stop."""
        if not self._exits:
            return None
        last = self._exits[-1]["failure"]
        count = 0
        for entry in reversed(self._exits):
            if entry["failure"] != last:
                break
            count += 1
        return Streak(str(last), count)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record how the run inside ends: ``stopped`` when it returns, else ``crashed``."""
        try:
            yield
        except BaseException as exc:
            self.crashed(describe_failure(exc))
            raise
        self.stopped()

    def crashed(self, failure: str) -> None:
        """Record that this run ended with ``failure``."""
        self._exits.append({"ts_ns": self._now_ns(), "failure": failure[:_FAILURE_CHARS]})
        self._exits = self._exits[-_KEEP:]
        self._write(running=False)

    def stopped(self) -> None:
        """Record a clean stop: the streak is over."""
        self._exits = []
        self._write(running=False)

    def _now_ns(self) -> int:
        return self._clock_ns()

    def _read(self) -> tuple[bool, list[dict[str, object]]]:
        try:
            if self.path.stat().st_size > _MAX_FILE_BYTES:
                msg = f"larger than {_MAX_FILE_BYTES} bytes"
                raise ValueError(msg)  # noqa: TRY301 - one handler for every bad file
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            running = raw["running"]
            exits = [
                {"ts_ns": int(e["ts_ns"]), "failure": str(e["failure"])[:_FAILURE_CHARS]}
                for e in raw["exits"]
            ]
            if not isinstance(running, bool):
                msg = "running is not a boolean"
                raise TypeError(msg)  # noqa: TRY301
        except FileNotFoundError:
            return False, []
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
            self._log.warning("exit_record_unreadable", path=str(self.path), error=str(exc))
            return False, []
        return running, exits

    def _write(self, *, running: bool) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"running": running, "exits": self._exits}), "utf-8")
            tmp.replace(self.path)
        except OSError as exc:
            self._log.warning("exit_record_not_saved", path=str(self.path), error=str(exc))
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
