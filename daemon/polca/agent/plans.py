"""What the agent core hands its shell: GPU writes to carry out and effects to emit, as data.

Every call into ``AgentCore`` that changes something returns one of these. ``Effects`` are
the messages to publish (already numbered and stamped, in order), the log lines to emit and
the systemd status to show; the plans (``StepPlan``, ``ResumePlan``, ``StopPlan``) add the
GPU writes the core wants made. The shell (``runtime.py``, ``gpus.py``) carries them out
and hands what the writes did back to the core (``note_step``, ``note_resume``,
``note_stop``), which says what follows from it. ``LogBook`` and ``EventSink`` are how the
core's parts (``intake.py``, ``fleet.py``, ``step.py``, ``ending.py``) log and queue events
for those effects without holding the core. Nothing here decides, does I/O or imports the
core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from polca.agent.actuator import ApplyResult, GpuPlan
from polca.agent.baseline import Baseline
from polca.gpu.backend import GpuSample
from polca.policy import Decision
from polca.telemetry.messages import OutMessage

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True, slots=True)
class LogLine:
    """One structured log line the shell emits: ``log.<level>(event, **fields)``."""

    level: LogLevel
    event: str
    fields: Mapping[str, Any]


class LogBook:
    """A logger that keeps its lines for the shell instead of emitting them.

    The core logs through one (``debug``/``info``/``warning``/``error``, as structlog's
    bound loggers, so helpers such as ``DropLog`` take it as their logger) and ``take``
    empties it into the ``Effects`` of the call that wrote them.
    """

    def __init__(self) -> None:
        """An empty book."""
        self._lines: list[LogLine] = []

    def debug(self, event: str, **fields: Any) -> None:
        """Keep a debug line."""
        self._lines.append(LogLine("debug", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        """Keep an info line."""
        self._lines.append(LogLine("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        """Keep a warning line."""
        self._lines.append(LogLine("warning", event, fields))

    def error(self, event: str, **fields: Any) -> None:
        """Keep an error line (``exc_info`` may carry the exception, for its traceback)."""
        self._lines.append(LogLine("error", event, fields))

    def take(self) -> tuple[LogLine, ...]:
        """Every line kept since the last ``take``, in order; the book is empty after."""
        lines, self._lines = tuple(self._lines), []
        return lines


class EventSink(Protocol):
    """Queues one event of the node (``AgentCore.event``: it adds the GPU's UUID;
    ``Outbox.add_event`` numbers it)."""

    def __call__(self, name: str, *, now_ns: int, gpu: int | None = None, **detail: Any) -> None:
        """Queue event ``name`` stamped ``now_ns``."""


@dataclass(frozen=True, slots=True)
class Effects:
    """What the shell must do after one call into the core, besides GPU writes.

    ``messages`` go to the bus in this order (their ``seq`` ascends); ``status_line`` is
    systemd's new ``STATUS=`` when it changed (None: leave it).
    """

    messages: tuple[OutMessage, ...] = ()
    logs: tuple[LogLine, ...] = ()
    status_line: str | None = None

    def to_send(self, *, status_topic: str, connected: bool) -> list[OutMessage]:
        """The messages to queue on the bus now: all while connected; while disconnected
        all but the node's status, which the next connection's birth carries as it is
        then (a queued one would follow the birth's and state an old status)."""
        if connected:
            return list(self.messages)
        return [m for m in self.messages if m.topic != status_topic]


@dataclass(frozen=True, slots=True)
class Received:
    """What one received message makes the shell do: emit ``effects``, save ``policy_copy``
    (the text of a newly adopted aggregator policy) as the local copy, wake the controller."""

    wake: bool = False
    policy_copy: str | None = None
    effects: Effects = field(default_factory=Effects)


@dataclass(frozen=True, slots=True)
class Sampled:
    """One round of readings taken: the good samples, by GPU index."""

    samples: Mapping[int, GpuSample]
    effects: Effects


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One control step: the decision to carry out and the writes it needs.

    ``writes`` is empty when nothing needs writing (then there is nothing to feed back);
    otherwise the shell executes them and hands the results to ``AgentCore.note_step``.
    ``taken``: ``decision`` was decided in this step (False: the one in force, carried out
    again to put back a limit someone else moved); ``targets_changed``: the caps in force
    changed (the state is republished after the writes). ``effects`` are due at once,
    before any write.
    """

    decision: Decision | None
    writes: tuple[GpuPlan, ...]
    taken: bool
    targets_changed: bool
    effects: Effects


@dataclass(frozen=True, slots=True)
class Applied:
    """What a step's writes did, and what follows from it."""

    result: ApplyResult
    effects: Effects


@dataclass(frozen=True, slots=True)
class ResumePlan:
    """The fail-safe caps at start-up, after a run that did not restore the GPUs.

    ``kept``: the baseline left behind was kept on purpose (``on_stop: keep`` or
    ``fail_safe``), not by a crash. ``writes`` may be empty (the GPUs already comply).
    """

    decision: Decision
    writes: tuple[GpuPlan, ...]
    kept: bool


StopMode = Literal["none", "restore", "fail_safe", "keep"]
"""How control ends: ``none`` (observe-only, or no GPUs), ``restore`` the originals,
``fail_safe`` caps (or tighter ones in force), or ``keep`` the caps in force."""


@dataclass(frozen=True, slots=True)
class StopPlan:
    """What the end of control requires: save ``save`` (when set), then make ``writes``.

    ``reason`` is the final status's (``stopped`` or ``failed``); ``clean``, an
    operator-asked stop. The shell bounds the whole in time and hands the results (None
    when the bound ran out) to ``AgentCore.note_stop``.
    """

    mode: StopMode
    reason: str
    clean: bool
    save: Baseline | None = None
    writes: tuple[GpuPlan, ...] = ()
    decision: Decision | None = None


@dataclass(frozen=True, slots=True)
class Stopped:
    """How control ended: the reason for the final status, whether the saved baseline is
    done with (every GPU restored: remove the file), and what to emit."""

    reason: str
    remove_baseline: bool
    effects: Effects
