"""A GPU profile against published measurements, and re-fitted to them (pure, numpy).

``polca/data/published/points.yaml`` holds what papers report about inference GPUs that the
simulator's model can be held to: how much longer work takes at a locked SM clock, how
much longer decode takes under a power limit, what decode and prefill draw, what a GPU
with a resident model idles at. Each point is a band (the reading of a qualitative
statement such as "negligible" is stated with the point) and names its GPUs.

- ``predict`` evaluates one point on a ``SimGpu`` with the model's own relations
  (``physics.power.work_slowdown`` for time against clock, ``SimGpu.clock_for_limit`` for
  the clock a limit leaves, ``SimGpu.decode_frac`` / ``prefill_frac`` for power), so the
  check is of the model the simulator runs, not of a copy of it.
- ``miss`` is how far a prediction falls outside its band, in units of the band's width
  (0 inside).
- ``fit`` moves the constants the points constrain (``FITTED``) to minimise the squared
  misses plus the squared distance from the shipped values in units of the prior's sigma
  (a maximum a posteriori fit with a Gaussian prior around the shipped profile), by
  coordinate descent on a grid inside the profile's bounds. Deterministic.

``bench/published_fit.py`` runs the fit for the shipped A100 and H100 profiles, writes the
fitted profiles and draws the curves against the points (docs/simulator.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polca import yamlkit
from polca.errors import SimConfigError
from polca.physics import power
from polca.physics.power import FloatT
from polca.sim.model import SimGpu
from polca.sim.profile import SimProfile, dump_profile, load_model, parse_model

POINTS_LIMITS: Final = yamlkit.YamlLimits(max_bytes=128 * 1024, max_depth=6, max_aliases=0)
FittedName = Literal[
    "prefill_clock_exponent",
    "decode_clock_exponent",
    "decode_mem_share",
    "decode_power_base_frac",
    "decode_power_max_frac",
]
FITTED: Final[tuple[FittedName, ...]] = get_args(FittedName)
"""The constants the published points constrain; every other field keeps its value."""
BOUNDS: Final[dict[str, tuple[float, float]]] = {
    "prefill_clock_exponent": (0.0, 1.5),
    "decode_clock_exponent": (0.0, 1.0),
    "decode_mem_share": (0.0, 0.95),
    "decode_power_base_frac": (0.1, 1.0),
    "decode_power_max_frac": (0.1, 1.2),
}

_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)
_Text = Annotated[str, Field(min_length=1, max_length=1_000)]
_Gpus = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=64)]],
    Field(min_length=1, max_length=16),
]
_Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Point(BaseModel):
    model_config = _CONFIG

    id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")]
    gpus: _Gpus
    source: _Text
    reading: _Text


class ClockLatency(_Point):
    """Work with ``decode_share`` of its busy time decoding, at a locked SM clock: its time
    over its time at the maximum clock lies in [low, high]."""

    kind: Literal["clock_latency"]
    sm_clock_mhz: _Positive
    decode_share: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
    low: _Positive
    high: _Positive


class DecodeLimitLatency(_Point):
    """A decode batch of ``batch`` under a power limit: its time per token over the
    uncapped time per token lies in [low, high]."""

    kind: Literal["decode_limit_latency"]
    power_limit_w: _Positive
    batch: Annotated[int, Field(ge=1, le=4096)]
    low: _Positive
    high: _Positive


class DecodePower(_Point):
    """Decode at the maximum clock draws within [low_w, high_w] from a batch of
    ``batch_low`` to one of ``batch_high``."""

    kind: Literal["decode_power"]
    batch_low: Annotated[int, Field(ge=1, le=4096)]
    batch_high: Annotated[int, Field(ge=1, le=4096)]
    low_w: _Positive
    high_w: _Positive


class PrefillPower(_Point):
    """A prompt of ``ctx_tokens`` at the maximum clock draws [low_frac, high_frac] x TDP."""

    kind: Literal["prefill_power"]
    ctx_tokens: _Positive
    low_frac: _Positive
    high_frac: _Positive


class ResidentPower(_Point):
    """A GPU with a model loaded and nothing running draws within [low_w, high_w]."""

    kind: Literal["resident_power"]
    low_w: _Positive
    high_w: _Positive


Point = ClockLatency | DecodeLimitLatency | DecodePower | PrefillPower | ResidentPower


class Prior(BaseModel):
    """How far a fitted constant may move from its shipped value, in one sigma."""

    model_config = _CONFIG

    sigma: _Positive
    why: _Text


class PublishedPoints(BaseModel):
    """The whole points file."""

    model_config = _CONFIG

    schema_version: Literal[1]
    points: Annotated[
        list[Annotated[Point, Field(discriminator="kind")]],
        Field(min_length=1, max_length=256),
    ]
    prior: dict[FittedName, Prior]

    @model_validator(mode="after")
    def _bands_and_ids(self) -> PublishedPoints:
        ids = [p.id for p in self.points]
        if len(set(ids)) != len(ids):
            msg = "point ids must be unique"
            raise ValueError(msg)
        for p in self.points:
            lo, hi = _band(p)
            if lo >= hi:
                msg = f"point {p.id}: its band's low end must be below its high end"
                raise ValueError(msg)
            if isinstance(p, DecodePower) and p.batch_low > p.batch_high:
                msg = f"point {p.id}: batch_low must not exceed batch_high"
                raise ValueError(msg)
        missing = set(FITTED) - set(self.prior)
        if missing:
            msg = f"prior: no sigma for {', '.join(sorted(missing))}"
            raise ValueError(msg)
        return self

    def for_gpu(self, name: str) -> tuple[Point, ...]:
        """The points that name GPU ``name`` (case-insensitive)."""
        key = name.lower()
        return tuple(p for p in self.points if key in (g.lower() for g in p.gpus))


def _band(point: Point) -> tuple[float, float]:
    if isinstance(point, ClockLatency | DecodeLimitLatency):
        return point.low, point.high
    if isinstance(point, PrefillPower):
        return point.low_frac, point.high_frac
    return point.low_w, point.high_w


def parse_points(text: str, *, source: str) -> PublishedPoints:
    """Validate a points file's YAML; errors name ``source`` (``SimConfigError``)."""
    return parse_model(
        PublishedPoints, text, what="published points", source=source, limits=POINTS_LIMITS
    )


def load_points(path: Path | None = None) -> PublishedPoints:
    """The points at ``path``, or the shipped ``polca/data/published/points.yaml``."""
    if path is not None:
        return load_model(PublishedPoints, path, what="published points", limits=POINTS_LIMITS)
    shipped = resources.files("polca").joinpath("data", "published", "points.yaml")
    return parse_points(
        shipped.read_text(encoding="utf-8"), source="polca/data/published/points.yaml"
    )


def clock_slowdown(gpu: SimGpu, clock_frac: FloatT, *, decode_share: float) -> FloatT:
    """How much longer work takes at ``clock_frac`` of the maximum SM clock, by ``gpu``'s
    clock exponents (``physics.power.work_slowdown``)."""
    return power.work_slowdown(
        clock_frac,
        decode_share=decode_share,
        prefill_clock_exponent=gpu.prefill_clock_exponent,
        decode_clock_exponent=gpu.decode_clock_exponent,
    )


def decode_slowdown_at_limit(gpu: SimGpu, *, batch: int, limit_w: float) -> float:
    """Time per token of a decode batch under ``limit_w``, over its uncapped time."""
    full_w = np.array([gpu.decode_frac(np.array([float(batch)]))[0] * gpu.tdp_w])
    clock = float(gpu.clock_for_limit(full_w, np.array([limit_w]), gpu.decode_mem_share)[0])
    return clock_slowdown(gpu, clock, decode_share=1.0)


def predict(gpu: SimGpu, point: Point) -> tuple[float, ...]:
    """What the model says for ``point``: one value, or the two ends of a range."""
    if isinstance(point, ClockLatency):
        frac = min(1.0, point.sm_clock_mhz / gpu.sm_clock_max_mhz)
        return (clock_slowdown(gpu, frac, decode_share=point.decode_share),)
    if isinstance(point, DecodeLimitLatency):
        return (decode_slowdown_at_limit(gpu, batch=point.batch, limit_w=point.power_limit_w),)
    if isinstance(point, DecodePower):
        batches = np.array([float(point.batch_low), float(point.batch_high)])
        watts = gpu.decode_frac(batches) * gpu.tdp_w
        return float(watts[0]), float(watts[1])
    if isinstance(point, PrefillPower):
        return (float(gpu.prefill_frac(np.array([point.ctx_tokens]))[0]),)
    return (gpu.resident_power_w,)


def misses(point: Point, predicted: Sequence[float]) -> list[float]:
    """How far each predicted value lies outside the point's band, in band widths (0
    inside)."""
    lo, hi = _band(point)
    return [max(lo - v, v - hi, 0.0) / (hi - lo) for v in predicted]


def miss(point: Point, predicted: Sequence[float]) -> float:
    """The larger miss of a prediction (one value, or both ends of a range)."""
    return max(misses(point, predicted))


@dataclasses.dataclass(frozen=True, slots=True)
class FitResult:
    """The constants before and after, and each point's prediction and miss for both."""

    gpu: str
    before: dict[str, float]
    after: dict[str, float]
    rows: list[dict[str, object]]
    cost_before: float
    cost_after: float


def _cost(
    gpu: SimGpu, base: SimGpu, points: Sequence[Point], prior: Mapping[FittedName, Prior]
) -> float:
    data = sum(m**2 for p in points for m in misses(p, predict(gpu, p)))
    drift = sum(((getattr(gpu, k) - getattr(base, k)) / prior[k].sigma) ** 2 for k in FITTED)
    return float(data + drift)


def _consistent(gpu: SimGpu) -> SimGpu:
    # The decode power of one request never exceeds the batch's ceiling.
    if gpu.decode_power_base_frac > gpu.decode_power_max_frac:
        return dataclasses.replace(gpu, decode_power_base_frac=gpu.decode_power_max_frac)
    return gpu


def fit(base: SimGpu, published: PublishedPoints, *, passes: int = 8, grid: int = 61) -> FitResult:
    """The maximum a posteriori fit of ``FITTED`` to the points naming ``base``'s GPU."""
    points = published.for_gpu(base.name)
    if not points:
        msg = f"no published point names GPU {base.name!r}"
        raise SimConfigError(msg)
    prior = published.prior
    best = base
    best_cost = _cost(best, base, points, prior)
    span = {k: (hi - lo) for k, (lo, hi) in BOUNDS.items()}
    for step in range(passes):
        shrink = 0.5**step
        for key in FITTED:
            lo, hi = BOUNDS[key]
            centre = float(getattr(best, key))
            half = span[key] * shrink / 2
            for value in np.linspace(max(lo, centre - half), min(hi, centre + half), grid):
                change: dict[str, Any] = {key: round(float(value), 4)}
                trial = _consistent(dataclasses.replace(best, **change))
                cost = _cost(trial, base, points, prior)
                if cost < best_cost - 1e-12:
                    best, best_cost = trial, cost
    rows: list[dict[str, object]] = []
    for p in points:
        lo, hi = _band(p)
        before, after = predict(base, p), predict(best, p)
        rows.append(
            {
                "id": p.id,
                "kind": p.kind,
                "band": [lo, hi],
                "shipped": [round(v, 4) for v in before],
                "fitted": [round(v, 4) for v in after],
                "miss_shipped": round(miss(p, before), 3),
                "miss_fitted": round(miss(p, after), 3),
            }
        )
    return FitResult(
        gpu=base.name,
        before={k: float(getattr(base, k)) for k in FITTED},
        after={k: float(getattr(best, k)) for k in FITTED},
        rows=rows,
        cost_before=round(_cost(base, base, points, prior), 4),
        cost_after=round(best_cost, 4),
    )


def fitted_profile(base: SimProfile, result: FitResult, *, name: str) -> str:
    """The text of ``base`` with the fitted constants of ``result``, each fitted one's source
    naming the points it was fitted to (``polca.sim.profile.dump_profile``)."""
    gpu, server = base.values()
    sources = base.sources()
    ids = ", ".join(str(row["id"]) for row in result.rows)
    for key, value in result.after.items():
        if value != result.before[key]:
            gpu[key] = value
            sources[key] = (
                f"fitted to published points ({ids}; polca/data/published/points.yaml), "
                f"prior {result.before[key]:g}: {sources[key]}"
            )
    return dump_profile(
        name,
        gpu,
        server,
        sources=sources,
        description=f"{base.description} Clock and decode constants re-fitted to published "
        "measurements (bench/published_fit.py).",
    )


__all__ = [
    "BOUNDS",
    "FITTED",
    "ClockLatency",
    "DecodeLimitLatency",
    "DecodePower",
    "FitResult",
    "PrefillPower",
    "PublishedPoints",
    "ResidentPower",
    "clock_slowdown",
    "decode_slowdown_at_limit",
    "fit",
    "fitted_profile",
    "load_points",
    "miss",
    "misses",
    "parse_points",
    "predict",
]
