"""Whether a row's meter is believed: one witness among the nodes, bounded like them (pure).

A meter (a PDU, a switchboard's power meter) is the one source that can override what the
nodes report, so it is held to what physics allows, each rule against the nodes' own
reports as ``rollup.py`` counts them:

- **implausible**: above what the row can draw (``ceiling_w``: the row's ``meter_max_w``,
  else the sum of its nodes' plausible maxima with their non-GPU power). A 10 MW reading
  for a 12 kW row brakes nothing.
- **under_reading**: below ``min_fraction`` of the whole-node power the row's fresh nodes
  report (their GPUs' power plus their configured non-GPU power). A meter cannot read less
  than what it feeds: a miswired current transformer or a feed left out of the sum would
  otherwise hold a row at level 0 while its true power crosses every threshold.
- **frozen**: the same value for ``frozen_readings`` readings in a row while the row's
  computed power moved by more than ``frozen_change_fraction`` (a hung PDU management card
  keeps answering its last value); not used until the value moves.

A refused reading is not the row's power: the computed power is. After a refusal the meter
is **held** for ``hold_s``: its readings count only as a floor (the row runs on the larger
of the meter and the computed power), so the choice does not flap between the two from one
reading to the next, and a meter that recovers cannot uncap the row at once. Each episode
of distrust is one ``meter_distrusted`` change when it starts (and one more for each other
reason during it) and one ``meter_trusted`` when the meter is used again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["MeterJudgement", "MeterWitness", "TrustChange", "WitnessSettings"]

Refusal = Literal["implausible", "under_reading", "frozen"]
Verdict = Literal["used", "held", "implausible", "under_reading", "frozen"]


@dataclass(frozen=True, slots=True)
class WitnessSettings:
    """How far a meter is believed (``ControlSettings``' ``meter_*`` fields)."""

    min_fraction: float = 0.9
    hold_s: float = 30.0
    frozen_readings: int = 10
    frozen_change_fraction: float = 0.05


@dataclass(frozen=True, slots=True)
class MeterJudgement:
    """One fresh meter reading, judged at a step."""

    verdict: Verdict
    """``used``: it is the row's power; ``held``: a floor under the computed power (within
    ``hold_s`` of a refusal); otherwise why it was refused."""
    reading_w: float
    bound_w: float | None = None
    """The bound a refused reading broke (the ceiling or the floor), or for ``frozen`` the
    computed power's change while it did not move."""
    held_s: float | None = None
    """``held``: seconds until the meter may be used again."""

    def note(self) -> str:
        """Why the row does not run on this reading alone ('' when it does)."""
        r = f"{self.reading_w:.0f} W"
        if self.verdict == "implausible":
            return f"meter reading {r} above what the row can draw ({self.bound_w:.0f} W)"
        if self.verdict == "under_reading":
            return f"meter reading {r} below the nodes' own power (floor {self.bound_w:.0f} W)"
        if self.verdict == "frozen":
            return f"meter reading frozen at {r} while the nodes' power moved {self.bound_w:.0f} W"
        if self.verdict == "held":
            return (
                f"meter {r} held for {self.held_s:.0f} s more after a refusal: the larger "
                "of meter and computed power is used"
            )
        return ""


@dataclass(frozen=True, slots=True)
class TrustChange:
    """A change of a meter's standing worth one log line, event and annotation."""

    event: Literal["meter_distrusted", "meter_trusted"]
    fields: dict[str, object]


@dataclass(slots=True)
class MeterWitness:
    """One row's meter: what it last read, and whether it is believed."""

    settings: WitnessSettings = field(default_factory=WitnessSettings)
    refusals: Counter[str] = field(default_factory=Counter)
    """Refused readings by reason, since start (each reading once, however many steps)."""
    _last_w: float | None = None
    _same: int = 0  # consecutive readings with the value ``_last_w``
    _run_start_computed_w: float = 0.0  # the row's computed power when that run began
    _frozen: bool = False  # this run of one value was found frozen: until the value moves
    _reading_id: int = 0  # counts readings, so a reading is counted refused once
    _counted_id: int = -1
    _refused_s: float | None = None  # the last refusal (monotonic)
    _episode_since_s: float | None = None  # distrusted since (None: trusted)
    _episode_reasons: set[str] = field(default_factory=set)
    _episode_refused: int = 0

    @property
    def trusted(self) -> bool:
        """Whether the meter is believed now (no distrust episode open)."""
        return self._episode_since_s is None

    def reading(self, power_w: float, *, computed_w: float) -> None:
        """A whole reading arrived while the row's computed power was ``computed_w``."""
        self._reading_id += 1
        if power_w == self._last_w:
            self._same += 1
            return
        self._last_w = power_w
        self._same = 1
        self._run_start_computed_w = computed_w
        self._frozen = False

    def judge(
        self,
        reading_w: float,
        *,
        now_s: float,
        reported_w: float,
        ceiling_w: float,
        computed_w: float,
    ) -> tuple[MeterJudgement, list[TrustChange]]:
        """The fresh reading ``reading_w`` at ``now_s``, against what the nodes report
        (``reported_w``, fresh nodes' whole-node power), what the row can draw
        (``ceiling_w``) and the computed row power; what changed about its standing."""
        s = self.settings
        refusal: Refusal | None = None
        bound_w = 0.0
        moved_w = abs(computed_w - self._run_start_computed_w)
        if reading_w > ceiling_w:
            refusal, bound_w = "implausible", ceiling_w
        elif reading_w < s.min_fraction * reported_w:
            refusal, bound_w = "under_reading", s.min_fraction * reported_w
        elif self._frozen or (
            self._same >= s.frozen_readings
            and moved_w > s.frozen_change_fraction * max(self._run_start_computed_w, computed_w)
        ):
            self._frozen = True
            refusal, bound_w = "frozen", moved_w
        if refusal is not None:
            return MeterJudgement(refusal, reading_w, bound_w), self._refused(
                refusal, reading_w, bound_w, now_s
            )
        if self._refused_s is not None and now_s - self._refused_s < s.hold_s:
            held_s = s.hold_s - (now_s - self._refused_s)
            return MeterJudgement("held", reading_w, held_s=held_s), []
        return MeterJudgement("used", reading_w), self._trusted(now_s)

    def _refused(
        self, reason: Refusal, reading_w: float, bound_w: float, now_s: float
    ) -> list[TrustChange]:
        if self._counted_id != self._reading_id:
            self._counted_id = self._reading_id
            self.refusals[reason] += 1
            self._episode_refused += 1
        self._refused_s = now_s
        changes: list[TrustChange] = []
        if self._episode_since_s is None or reason not in self._episode_reasons:
            changes.append(
                TrustChange(
                    "meter_distrusted",
                    {
                        "reason": reason,
                        "reading_w": round(reading_w, 1),
                        "bound_w": round(bound_w, 1),
                    },
                )
            )
        if self._episode_since_s is None:
            self._episode_since_s = now_s
        self._episode_reasons.add(reason)
        return changes

    def _trusted(self, now_s: float) -> list[TrustChange]:
        if self._episode_since_s is None:
            return []
        change = TrustChange(
            "meter_trusted",
            {
                "distrusted_s": round(now_s - self._episode_since_s, 3),
                "refused_readings": self._episode_refused,
                "reasons": sorted(self._episode_reasons),
            },
        )
        self._episode_since_s = None
        self._episode_reasons = set()
        self._episode_refused = 0
        return [change]
