"""The error taxonomy of polca, classified by what the caller does next.

Every library error (NVML, MQTT, YAML, pydantic) is translated into one of these at the
seam where it happens, always chained with ``raise ... from exc`` so the root cause stays
visible. Callers branch on the class, never on message text:

- ``RetryableError``: try again later (after ``delay_s``); the process keeps running.
- ``FatalError``: stop the process with the message, which says how to fix the cause.
- ``GpuLostError``: one GPU is gone; mark it lost and carry on with the others.
"""

from __future__ import annotations

from dataclasses import dataclass


class PolcaError(Exception):
    """Root of every error polca raises on purpose."""


class RetryableError(PolcaError):
    """A transient failure: the same operation may succeed after ``delay_s`` seconds."""

    def __init__(self, msg: str, *, delay_s: float = 1.0) -> None:
        super().__init__(msg)
        self.delay_s = delay_s


class FatalError(PolcaError):
    """A failure the process cannot recover from by itself; the message says how to fix it."""


class ConfigError(FatalError):
    """Invalid settings (configuration file or ``POLCA_*`` environment)."""


class GpuError(PolcaError):
    """A GPU backend failure, optionally tied to one GPU by index."""

    def __init__(self, msg: str, *, index: int | None = None, code: int | None = None) -> None:
        super().__init__(msg)
        self.index = index
        self.code = code


class GpuLibraryError(GpuError, FatalError):
    """The management library cannot be used at all (missing, driver not loaded, mismatch)."""


class GpuPermissionError(GpuError, FatalError):
    """A write needs privileges the process lacks; the message says how to grant them."""


class GpuLostError(GpuError):
    """The GPU fell off the bus or needs a reset; stop commanding it, keep the others."""


class GpuNotSupportedError(GpuError):
    """The GPU does not support the requested operation."""


class GpuInvalidArgumentError(GpuError):
    """A value was outside what the GPU accepts (limit out of range, unsupported clock)."""


class GpuTransientError(GpuError, RetryableError):
    """A GPU call failed in a way that may succeed when retried (timeout, busy, no data)."""

    def __init__(
        self, msg: str, *, index: int | None = None, code: int | None = None, delay_s: float = 0.1
    ) -> None:
        GpuError.__init__(self, msg, index=index, code=code)
        self.delay_s = delay_s


class PolicyError(PolcaError):
    """A policy file is invalid; ``problems`` holds one ``FILE:LINE:COL: message`` each."""

    def __init__(self, msg: str, *, problems: tuple[str, ...] = ()) -> None:
        super().__init__(msg)
        self.problems = problems


class TransportError(RetryableError):
    """The message bus is unreachable or refused an operation."""


class TransportAuthError(TransportError, FatalError):
    """The broker rejected our credentials: retrying with the same ones cannot help."""


class ReadingRejectedError(PolcaError):
    """A device (a PDU, a CDU, a BMC) answered, but not with a value polca can use.

    ``reason`` names the drop counter: ``type`` (not a number), ``nan`` (NaN or infinite),
    ``negative``, ``absurd`` (out of the plausible range), ``unsupported`` (every value
    that could be used was "not supported", APC's ``-1``), ``oversized`` (a reply larger
    than the bound), ``malformed`` (not the structure the protocol promises), ``identity``
    (not the device configured), ``redirect`` (sent to another host), ``not_found``,
    ``refused`` (a request the device turned down, e.g. a limit out of its range).
    """

    def __init__(self, msg: str, *, reason: str) -> None:
        """``msg`` says what was wrong; ``reason`` is the drop counter's name."""
        super().__init__(msg)
        self.reason = reason


class SchemaError(PolcaError, ValueError):
    """A received payload that polca does not accept; ``reason`` is its drop counter's name.

    Raised by the wire decoder (``polca.telemetry.schema.decode``) and the admission checks
    (``polca.telemetry.checks``); listeners count and drop the message by ``reason`` and
    carry on. Subclasses refine the reason; callers branch on the class, not the text.
    """

    reason: str = "malformed"


class OversizedError(SchemaError):
    """A payload larger than the decoder accepts, refused before parsing."""

    reason = "oversized"


class SchemaVersionError(SchemaError):
    """A payload of a ``schema_version`` this polca does not speak."""

    reason = "schema_version"


class IdentityError(SchemaError):
    """A payload naming another node, rack, row or CDU than the topic it came on."""

    reason = "identity"


class ClockSkewError(SchemaError):
    """A wall-clock stamp outside the receiver's skew tolerance (e.g. far in the future)."""

    reason = "clock_skew"


class StaleMessageError(SchemaError):
    """A message too old to act on (a retained reading or an expired control)."""

    reason = "stale"


class InfluxUnavailableError(RetryableError):
    """The database did not take a batch now (unreachable, overloaded, misconfigured).

    The batch is kept and sent again later; ``status`` is the HTTP status, if any.
    """

    def __init__(self, msg: str, *, status: int | None = None, delay_s: float = 0.0) -> None:
        super().__init__(msg, delay_s=delay_s)
        self.status = status


class BatchRejectedError(PolcaError):
    """The database refused a batch's data (HTTP 4xx): sending it again cannot help.

    ``kind`` identifies the class of error for logging once; ``dropped_points`` is the
    number of points the database says it dropped (a partial write), when it says so.
    """

    def __init__(self, msg: str, *, status: int, kind: str, dropped_points: int | None) -> None:
        super().__init__(msg)
        self.status = status
        self.kind = kind
        self.dropped_points = dropped_points


class UnexpectedReturnError(PolcaError, RuntimeError):
    """An eternal task returned; the supervisor treats that as a failure."""


class StopRequestedError(PolcaError):
    """Raised inside a supervisor's TaskGroup to end it when a stop was requested."""


class SimConfigError(ConfigError):
    """A simulation cannot run with these inputs; the message names the input at fault."""


class SimCollapsedError(PolcaError):
    """A simulated row stopped serving its load (requests pile up without bound) or ran past
    its time limit: the run is abandoned and the point reported as collapsed."""

    def __init__(self, message: str, *, at_s: float, in_flight: int) -> None:
        """``at_s``: simulated time of the collapse; ``in_flight``: requests then."""
        super().__init__(message)
        self.at_s = at_s
        self.in_flight = in_flight


class TraceError(ConfigError):
    """A trace file cannot be used; the message starts with ``FILE:LINE:``."""


@dataclass(frozen=True, slots=True)
class YamlProblem:
    """One thing wrong with a text, at a 1-based line and column when known."""

    message: str
    line: int | None = None
    column: int | None = None


class YamlError(PolcaError):
    """YAML text that polca refuses (malformed, or beyond a bound); ``problems`` says where.

    ``str()`` is ``SOURCE:LINE:COL: message`` of the first problem; callers translate the
    error into their own (``PolicyError``, ``ConfigError``), chained with ``from``.
    """

    def __init__(self, source: str, problems: tuple[YamlProblem, ...]) -> None:
        """``problems`` holds at least one problem, in text order."""
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{_where(source, first)}: {first.message}{more}")
        self.source = source
        self.problems = problems

    @property
    def line(self) -> int | None:
        """1-based line of the first problem, if known."""
        return self.problems[0].line

    @property
    def column(self) -> int | None:
        """1-based column of the first problem, if known."""
        return self.problems[0].column

    def lines(self) -> tuple[str, ...]:
        """Each problem as ``SOURCE:LINE:COL: message`` (1:1 when the text gives no place)."""
        return tuple(
            f"{self.source}:{p.line or 1}:{p.column or 1}: {p.message}" for p in self.problems
        )


def _where(source: str, problem: YamlProblem) -> str:
    if problem.line is None:
        return source
    return f"{source}:{problem.line}:{problem.column or 1}"
