"""The policy YAML as pydantic models: the trust boundary between operators and the engine.

A policy says, per priority class, which caps each POLCA level applies, which per-GPU
thermal guards run in parallel, and what to do when the row controller goes silent. Every
rule that can be checked without hardware is checked here, so a ``Policy`` instance is
always safe to hand to ``polca.policy.engine``: thresholds ascend, a higher level never
loosens a cap, every class name is declared.

Cross-field rules raise one ``PydanticCustomError`` of type ``RULE_ERROR_TYPE`` whose
context carries every problem as ``(relative location, message)``; the loader turns each
into its own ``FILE:LINE:COL`` line. This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

SCHEMA_VERSION = 1
"""The only ``schema_version`` this polca reads."""

RULE_ERROR_TYPE = "policy_rule"
"""Pydantic error type of cross-field rule violations; ``ctx["problems"]`` lists them."""

KEY = "[key]"
"""Last element of a problem location that points at a mapping key, not at its value."""

Loc = tuple[str | int, ...]

_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]*$"

Name = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=_NAME_PATTERN,
        description="A letter, then letters, digits, '_', '.' or '-' (at most 64).",
    ),
]
Percent = Annotated[float, Field(gt=0, le=100)]
TempC = Annotated[float, Field(gt=0, le=150)]


def format_loc(loc: Sequence[str | int]) -> str:
    """Render a location as a YAML key path, e.g. ``levels[1].caps.low``."""
    out = ""
    for part in loc:
        if part == KEY:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _rule_error(problems: Sequence[tuple[Loc, str]]) -> PydanticCustomError:
    summary = "; ".join(f"{format_loc(loc)}: {msg}" if loc else msg for loc, msg in problems)
    return PydanticCustomError(
        RULE_ERROR_TYPE, "{summary}", {"summary": summary, "problems": tuple(problems)}
    )


class _Model(BaseModel):
    # strict: "80" is not a number and 1.5 is not an integer; YAML gives real types.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class CapSpec(_Model):
    """Caps on one GPU: at most one clock field, at most one power field, at least one field.

    Percentages are of the GPU's maximum SM clock and of its default power limit, resolved
    per GPU by the engine.
    """

    sm_clock_max_mhz: int | None = Field(
        None, gt=0, description="Lock the SM clock at or below this many MHz."
    )
    sm_clock_max_pct: Percent | None = Field(
        None, description="Lock the SM clock at or below this % of the GPU's maximum SM clock."
    )
    power_limit_w: float | None = Field(None, gt=0, description="Power limit in watts.")
    power_limit_pct: Percent | None = Field(
        None, description="Power limit as % of the GPU's default power limit."
    )

    @model_validator(mode="after")
    def _one_per_dimension(self) -> CapSpec:
        problems: list[tuple[Loc, str]] = []
        if self.sm_clock_max_mhz is not None and self.sm_clock_max_pct is not None:
            problems.append(
                (("sm_clock_max_pct", KEY), "give sm_clock_max_mhz or sm_clock_max_pct, not both")
            )
        if self.power_limit_w is not None and self.power_limit_pct is not None:
            problems.append(
                (("power_limit_pct", KEY), "give power_limit_w or power_limit_pct, not both")
            )
        if self.clock is None and self.power is None:
            problems.append(
                (
                    (),
                    "a cap needs at least one of sm_clock_max_mhz, sm_clock_max_pct, "
                    "power_limit_w, power_limit_pct",
                )
            )
        if problems:
            raise _rule_error(problems)
        return self

    @property
    def clock(self) -> tuple[str, float] | None:
        """The clock cap as ``(field name, value)``, or None."""
        if self.sm_clock_max_mhz is not None:
            return ("sm_clock_max_mhz", self.sm_clock_max_mhz)
        if self.sm_clock_max_pct is not None:
            return ("sm_clock_max_pct", self.sm_clock_max_pct)
        return None

    @property
    def power(self) -> tuple[str, float] | None:
        """The power cap as ``(field name, value)``, or None."""
        if self.power_limit_w is not None:
            return ("power_limit_w", self.power_limit_w)
        if self.power_limit_pct is not None:
            return ("power_limit_pct", self.power_limit_pct)
        return None


ClassCaps = dict[Name, CapSpec]


class Assignment(_Model):
    """Static priority class of GPUs; a runtime assignment (over MQTT) overrides it."""

    by_index: dict[Annotated[int, Strict(False), Field(ge=0)], Name] = Field(
        default_factory=dict, description="GPU index (as NVML numbers it) -> class."
    )
    by_uuid: dict[str, Name] = Field(
        default_factory=dict, description="GPU UUID ('GPU-...') -> class; beats by_index."
    )


class Level(_Model):
    """One capping level, entered when row power reaches ``threshold_pct`` of the budget."""

    name: Name = Field(description="Shown in reasons as 'level:<name>'.")
    threshold_pct: Percent = Field(
        description="Row power, in % of the row's effective power budget, that triggers it."
    )
    caps: ClassCaps = Field(
        default_factory=dict,
        description="Class -> caps at this level; a class not listed is not capped.",
    )


class Release(_Model):
    """How the row controller steps back down (hysteresis)."""

    margin_pct: Percent = Field(
        5.0,
        description="Release a level once row power is this many points below its threshold.",
    )
    dwell_s: float = Field(
        10.0, ge=0, description="Seconds power must stay below the release point first."
    )
    one_level_at_a_time: bool = Field(
        True, description="Step down one level per dwell; false jumps to the level power needs."
    )


class Trend(_Model):
    """Predictive brake: go to the top level if the power trend reaches 100% in time."""

    reaction_s: float = Field(
        gt=0, description="Brake when power + trend x reaction_s would reach 100% of budget."
    )


class ThermalGuard(_Model):
    """A per-GPU trigger on temperature, latched until the GPU cools below the release."""

    name: Name = Field(description="Shown in reasons as 'thermal:<name>'.")
    gpu_temp_c: TempC | None = Field(None, description="Trigger at this GPU temperature.")
    release_gpu_temp_c: TempC | None = Field(
        None, description="Release once the GPU temperature is below this."
    )
    mem_temp_c: TempC | None = Field(None, description="Trigger at this memory (HBM) temperature.")
    release_mem_temp_c: TempC | None = Field(
        None, description="Release once the memory temperature is below this."
    )
    caps: CapSpec | None = Field(None, description="Caps on every class while latched.")
    caps_by_class: ClassCaps = Field(
        default_factory=dict, description="Class -> caps while latched; overrides caps."
    )

    @model_validator(mode="after")
    def _triggers(self) -> ThermalGuard:
        problems: list[tuple[Loc, str]] = []
        pairs = (
            ("gpu_temp_c", self.gpu_temp_c, "release_gpu_temp_c", self.release_gpu_temp_c),
            ("mem_temp_c", self.mem_temp_c, "release_mem_temp_c", self.release_mem_temp_c),
        )
        for trig_key, trig_c, rel_key, rel_c in pairs:
            if trig_c is None and rel_c is not None:
                problems.append(((rel_key, KEY), f"{rel_key} given without {trig_key}"))
            elif trig_c is not None and rel_c is None:
                problems.append(((trig_key, KEY), f"{trig_key} needs {rel_key} (hysteresis)"))
            elif trig_c is not None and rel_c is not None and rel_c >= trig_c:
                problems.append(
                    ((rel_key,), f"{rel_key} ({rel_c:g}) must be below {trig_key} ({trig_c:g})")
                )
        if self.gpu_temp_c is None and self.mem_temp_c is None:
            problems.append(((), "a thermal guard needs gpu_temp_c or mem_temp_c"))
        if self.caps is None and not self.caps_by_class:
            problems.append(((), "a thermal guard needs caps or caps_by_class"))
        if problems:
            raise _rule_error(problems)
        return self

    def caps_for(self, priority_class: str) -> CapSpec | None:
        """The caps this guard applies to a GPU of ``priority_class`` while latched."""
        return self.caps_by_class.get(priority_class, self.caps)


class FailSafe(_Model):
    """Caps applied while no row controller holds a valid lease."""

    caps: ClassCaps = Field(
        description="Class -> caps; a class not listed is not capped. {} opts out."
    )
    max_lease_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="The longest lease an agent grants one control message, counted on its "
        "own monotonic clock from receipt; a longer lease is cut to this.",
    )


class Policy(_Model):
    """A complete polca policy (``schema_version: 1``)."""

    schema_version: Literal[1] = Field(description="Always 1.")
    name: Name = Field(description="Policy name, reported in telemetry.")
    description: str = Field("", description="Free text.")
    # Strict(False) on a tuple lets a YAML list in; its items stay strict.
    classes: Annotated[tuple[Name, ...], Strict(False)] = Field(
        description="Priority classes, most important first (at least one)."
    )
    default_class: Name = Field(description="Class of a GPU that no assignment names.")
    assignment: Assignment = Field(
        default_factory=Assignment, description="Static GPU -> class map."
    )
    levels: Annotated[tuple[Level, ...], Strict(False)] = Field(
        description="Capping levels by ascending threshold (at least one); level 0 "
        "(nominal, no caps) is implicit.",
    )
    release: Release = Field(default_factory=Release, description="Hysteresis on the way down.")
    trend: Trend | None = Field(None, description="Optional predictive brake.")
    thermal_guards: Annotated[tuple[ThermalGuard, ...], Strict(False)] = Field(
        (), description="Per-GPU temperature triggers, in parallel with the level."
    )
    fail_safe: FailSafe = Field(description="Caps while the controller's lease is not valid.")
    on_stop: Literal["restore", "keep", "fail_safe"] = Field(
        "restore",
        description="What a clean, operator-asked stop leaves on the GPUs. restore: the "
        "original limits; keep: the caps in force; fail_safe: the fail-safe caps (or the "
        "caps in force where tighter), for oversubscribed rows. Any other exit (a crash, "
        "a fatal error) always leaves at least the fail-safe caps.",
    )

    @model_validator(mode="after")
    def _rules(self) -> Policy:
        problems = [*self._class_problems(), *self._level_problems(), *self._guard_problems()]
        if problems:
            raise _rule_error(problems)
        return self

    def _class_problems(self) -> Iterator[tuple[Loc, str]]:
        # Length rules live here, not in Field(min_length=...): pydantic also reports a
        # length error when an item fails, which would point at the wrong place.
        if not self.classes:
            yield (("classes",), "declare at least one priority class")
        seen: set[str] = set()
        for i, name in enumerate(self.classes):
            if name in seen:
                yield (("classes", i), f"class {name!r} is declared twice")
            seen.add(name)
        yield from self._undeclared(("default_class",), self.default_class)
        for index, cls in self.assignment.by_index.items():
            yield from self._undeclared(("assignment", "by_index", index), cls)
        for uuid, cls in self.assignment.by_uuid.items():
            yield from self._undeclared(("assignment", "by_uuid", uuid), cls)
        for cls in self.fail_safe.caps:
            yield from self._undeclared(("fail_safe", "caps", cls, KEY), cls)

    def _undeclared(self, loc: Loc, name: str) -> Iterator[tuple[Loc, str]]:
        if name not in self.classes:
            declared = ", ".join(self.classes)
            yield (loc, f"class {name!r} is not declared in classes ({declared})")

    def _level_problems(self) -> Iterator[tuple[Loc, str]]:
        if not self.levels:
            yield (("levels",), "declare at least one level")
        names: set[str] = set()
        margin = self.release.margin_pct
        for i, level in enumerate(self.levels):
            if level.name in names:
                yield (("levels", i, "name"), f"level name {level.name!r} is used twice")
            names.add(level.name)
            for cls in level.caps:
                yield from self._undeclared(("levels", i, "caps", cls, KEY), cls)
            if i == 0:
                if margin >= level.threshold_pct:
                    yield (
                        ("release", "margin_pct"),
                        f"release.margin_pct ({margin:g}) must be below the lowest threshold "
                        f"({level.threshold_pct:g}), or level {level.name!r} never releases",
                    )
                continue
            below = self.levels[i - 1]
            if level.threshold_pct <= below.threshold_pct:
                yield (
                    ("levels", i, "threshold_pct"),
                    f"thresholds must ascend strictly: {level.name!r} ({level.threshold_pct:g}%)"
                    f" is not above {below.name!r} ({below.threshold_pct:g}%)",
                )
            elif level.threshold_pct - below.threshold_pct < margin:
                yield (
                    ("levels", i, "threshold_pct"),
                    f"{level.name!r} ({level.threshold_pct:g}%) is less than release.margin_pct "
                    f"({margin:g}) above {below.name!r} ({below.threshold_pct:g}%)",
                )
        yield from self._loosening_problems()

    def _loosening_problems(self) -> Iterator[tuple[Loc, str]]:
        # Per class and dimension, a cap may only tighten as levels rise; comparing needs one
        # unit per class and dimension, since % resolves against each GPU's hardware.
        for cls in dict.fromkeys(self.classes):  # once each, even if declared twice
            for dimension in ("clock", "power"):
                prev: tuple[int, str, float] | None = None
                for i, level in enumerate(self.levels):
                    spec = level.caps.get(cls)
                    cap = getattr(spec, dimension) if spec is not None else None
                    if cap is None:
                        if prev is not None:
                            where: Loc = ("levels", i, "caps", cls) if spec else ("levels", i)
                            yield (
                                where,
                                f"level {level.name!r} drops the {dimension} cap of class "
                                f"{cls!r} set by {self.levels[prev[0]].name!r}; a higher level "
                                "must never loosen a cap",
                            )
                        continue
                    key, value = cap
                    loc: Loc = ("levels", i, "caps", cls, key)
                    if prev is not None:
                        prev_level = self.levels[prev[0]].name
                        if key != prev[1]:
                            yield (
                                loc,
                                f"class {cls!r} uses {prev[1]} at {prev_level!r} and {key} at "
                                f"{level.name!r}; use one unit per class across levels",
                            )
                        elif value > prev[2]:
                            yield (
                                loc,
                                f"{key} {value:g} for class {cls!r} at {level.name!r} loosens "
                                f"{prev[2]:g} at {prev_level!r}; a higher level must never "
                                "loosen a cap",
                            )
                    prev = (i, key, value)

    def _guard_problems(self) -> Iterator[tuple[Loc, str]]:
        names: set[str] = set()
        for i, guard in enumerate(self.thermal_guards):
            if guard.name in names:
                yield (("thermal_guards", i, "name"), f"guard name {guard.name!r} is used twice")
            names.add(guard.name)
            for cls in guard.caps_by_class:
                yield from self._undeclared(("thermal_guards", i, "caps_by_class", cls, KEY), cls)

    def static_class(self, *, index: int, uuid: str) -> str:
        """The class the policy assigns a GPU: by UUID, then by index, then the default."""
        by_uuid = self.assignment.by_uuid.get(uuid)
        if by_uuid is not None:
            return by_uuid
        return self.assignment.by_index.get(index, self.default_class)

    @property
    def top_level(self) -> int:
        """The number of the highest level (the brake, by convention)."""
        return len(self.levels)

    def clamp_level(self, level: int) -> int:
        """``level`` clamped into ``[0, top_level]``: a level from outside this policy (a
        message, a retained seed, a forced floor, a reload that removed levels)."""
        return max(0, min(level, self.top_level))

    def level_name(self, level: int) -> str:
        """Name of level ``level``: ``nominal`` for 0, else the policy's level name."""
        return "nominal" if level <= 0 else self.levels[min(level, self.top_level) - 1].name
