"""Which leased, term-fenced message a receiver believes, and the lease it grants (pure).

Two messages are leased and fenced the same way: the row controller's ``Control`` (the
agent's ``agent/control.py`` ``ControlTracker``) and the site controller's ``Budget`` (the
aggregator's ``aggregator/budgets.py``). Each carries a ``Stamp``: the issuer's leadership
``term`` (an etcd create-revision, 0 without high availability), its start (``epoch_ns``)
and ``seq``, when it was issued and when its lease ends. ``LeaseFence`` keeps, per key (a
scope, a row), the order of the last one accepted, and judges a new one:

- ``future``: its ``epoch_ns`` lies beyond the tolerance in the future of both this clock
  and its own ``issued_ns`` (either clock may be skewed or have stepped, not both at once),
  or a retained one was issued beyond the tolerance in the future of this clock;
- ``skewed``: a live message whose stamp is more than ``MAX_PLAUSIBLE_SKEW_NS`` (a week)
  from this clock: its stamps are forged or broken;
- ``fenced``: a term below the highest accepted while any lease is still valid (a deposed
  issuer that still publishes); a lower term is accepted again once every lease has run
  out (an etcd cluster rebuilt from scratch restarts its revisions);
- ``term_jump``: a term above ``max_term`` (forged, always), or more than ``max_term_step``
  above the highest accepted while a lease of that term is valid (bounding a forged term to
  one lease);
- ``stale``: not newer by ``(epoch_ns, seq)`` than the last one of its key in the same
  term; a lower epoch (an issuer restarted after its clock stepped back) once the higher
  epoch's lease has run out;
- ``expired``: it grants no time (a lease that ends before it was issued, or a retained
  message older than its lease).

The lease runs on the receiver's **monotonic** clock from receipt, for ``lease_expires_ns -
issued_ns``, cut to ``max_lease_ns``; the wall clocks only order messages and age a
retained one. What it must not do: read a clock, or know a message's type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from polca.coord.leadership import MAX_PLAUSIBLE_TERM
from polca.telemetry.checks import ClockWindow

__all__ = [
    "DEFAULT_MAX_TERM",
    "DEFAULT_MAX_TERM_STEP",
    "MAX_PLAUSIBLE_SKEW_NS",
    "FenceVerdict",
    "LeaseFence",
    "Stamp",
]

FenceVerdict = Literal["granted", "stale", "expired", "future", "skewed", "fenced", "term_jump"]
DEFAULT_MAX_TERM_STEP = 2**32
"""A term more than this above the highest accepted waits for that term's lease to lapse."""
DEFAULT_MAX_TERM = MAX_PLAUSIBLE_TERM
"""No real leadership term is above this (an etcd revision: a trillion writes)."""
MAX_PLAUSIBLE_SKEW_NS = 7 * 86_400 * 1_000_000_000
"""Beyond this, a live message's stamp is not a skewed clock but a forged or broken one."""


@dataclass(frozen=True, slots=True)
class Stamp:
    """What orders and leases one message."""

    term: int
    epoch_ns: int
    seq: int
    issued_ns: int
    lease_expires_ns: int


@dataclass(frozen=True, slots=True)
class _Order:
    term: int
    epoch_ns: int
    seq: int
    expires_mono_ns: int


@dataclass(slots=True)
class LeaseFence:
    """The order of the last message accepted per key, and the highest term."""

    window: ClockWindow
    max_term_step: int = DEFAULT_MAX_TERM_STEP
    max_term: int = DEFAULT_MAX_TERM
    term: int = 0
    """The highest leadership term accepted (0: no high availability)."""
    _order: dict[str, _Order] = field(default_factory=dict)

    def judge(
        self,
        key: str,
        stamp: Stamp,
        *,
        received_mono_ns: int,
        received_wall_ns: int,
        retained: bool,
        max_lease_ns: int,
    ) -> tuple[FenceVerdict, int]:
        """The verdict on ``stamp`` for ``key`` and, when granted, the lease in ns."""
        newest_clock_ns = max(received_wall_ns, stamp.issued_ns)
        if stamp.epoch_ns - newest_clock_ns > self.window.tolerance_ns:
            return "future", 0
        if not retained and abs(received_wall_ns - stamp.issued_ns) > MAX_PLAUSIBLE_SKEW_NS:
            return "skewed", 0
        live = [order for order in self._order.values() if order.expires_mono_ns > received_mono_ns]
        if stamp.term < self.term and live:
            return "fenced", 0
        if stamp.term > self.max_term:
            return "term_jump", 0
        if stamp.term - self.term > self.max_term_step and any(
            order.term == self.term for order in live
        ):
            return "term_jump", 0
        last = self._order.get(key)
        if last is not None and stamp.term != last.term:
            last = None  # a new leader (or, the higher term lapsed, a rebuilt etcd's)
        if last is not None and (stamp.epoch_ns, stamp.seq) <= (last.epoch_ns, last.seq):
            restarted = stamp.epoch_ns < last.epoch_ns
            if not (restarted and last.expires_mono_ns <= received_mono_ns):
                return "stale", 0
        granted_ns = min(stamp.lease_expires_ns - stamp.issued_ns, max_lease_ns)
        if retained:
            age_ns = received_wall_ns - stamp.issued_ns
            if age_ns < -self.window.tolerance_ns:
                return "future", 0
            granted_ns -= max(0, age_ns)
        if granted_ns <= 0:
            return "expired", 0
        return "granted", granted_ns

    def accept(self, key: str, stamp: Stamp, *, expires_mono_ns: int) -> None:
        """Record ``stamp`` as the last accepted for ``key``, its lease ending then."""
        self._order[key] = _Order(stamp.term, stamp.epoch_ns, stamp.seq, expires_mono_ns)
        self.term = stamp.term  # the highest, or a lower one once the higher lapsed

    def forget(self, key: str) -> None:
        """Drop what is known of ``key`` (a row no longer held)."""
        self._order.pop(key, None)
