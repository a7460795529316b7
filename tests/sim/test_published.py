"""The profiles against published measurements: the points file is strict, predictions are
the simulator's own relations, the fit recovers known constants and never ends worse than
it started, and the shipped re-fitted profiles are what the fit writes today."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given

from polca.errors import SimConfigError
from polca.physics import power
from polca.sim import published
from polca.sim.model import SIM_GPUS, profile_gpu_and_server, sim_gpu
from polca.sim.profile import load_profile_file, parse_profile, shipped_profile
from tests.fuzzing import FUZZ, mutated

REPO = Path(__file__).resolve().parents[2]
SHIPPED_POINTS = REPO / "daemon" / "polca" / "data" / "published" / "points.yaml"
REFITTED = REPO / "daemon" / "polca" / "data" / "published"


def _doc() -> dict[str, object]:
    data = yaml.safe_load(SHIPPED_POINTS.read_text())
    assert isinstance(data, dict)
    return data


def _clock_point(mhz: float, ratio: float, *, width: float = 0.004) -> dict[str, object]:
    return {
        "id": f"p{int(mhz)}",
        "gpus": ["A100-SXM4"],
        "kind": "clock_latency",
        "sm_clock_mhz": mhz,
        "decode_share": 0.0,
        "low": ratio - width / 2,
        "high": ratio + width / 2,
        "source": "drawn by the test",
        "reading": "exact",
    }


def test_the_shipped_points_load_and_name_known_gpus() -> None:
    """Every point names GPUs the simulator has; the fitted constants each have a prior."""
    points = published.load_points()
    assert len(points.points) >= 5
    for point in points.points:
        for gpu in point.gpus:
            assert gpu.lower() in SIM_GPUS, (point.id, gpu)
    assert set(points.prior) == set(published.FITTED)
    assert points.for_gpu("a100-sxm4")
    assert points.for_gpu("H100-SXM")


def test_predictions_are_the_models_own_relations() -> None:
    """A clock point is ``work_slowdown``; a decode limit above decode power costs nothing,
    one below it costs time; decode power ends are the batch's power at max clock."""
    gpu = sim_gpu("H100-SXM")
    point = published.ClockLatency.model_validate(
        {**_clock_point(1500, 1.0), "gpus": ["H100-SXM"], "decode_share": 0.3}
    )
    expected = power.work_slowdown(
        1500 / gpu.sm_clock_max_mhz,
        decode_share=0.3,
        prefill_clock_exponent=gpu.prefill_clock_exponent,
        decode_clock_exponent=gpu.decode_clock_exponent,
    )
    assert published.predict(gpu, point)[0] == pytest.approx(expected)
    assert published.decode_slowdown_at_limit(gpu, batch=1, limit_w=gpu.tdp_w) == 1.0
    assert published.decode_slowdown_at_limit(gpu, batch=32, limit_w=300.0) > 1.05
    power_point = published.load_points().for_gpu("H100-SXM")
    ranged = next(p for p in power_point if isinstance(p, published.DecodePower))
    lo, hi = published.predict(gpu, ranged)
    assert lo == pytest.approx(gpu.decode_power_base_frac * gpu.tdp_w)
    assert hi == pytest.approx(gpu.decode_power_max_frac * gpu.tdp_w)


def test_a_miss_is_counted_in_band_widths() -> None:
    point = published.ClockLatency.model_validate(_clock_point(1305, 1.005, width=0.01))
    assert published.miss(point, (1.005,)) == 0.0
    assert published.miss(point, (1.03,)) == pytest.approx(2.0)
    assert published.miss(point, (0.995,)) == pytest.approx(0.5)


def test_the_fit_recovers_a_known_exponent() -> None:
    """Tight points drawn at prefill exponent 0.6 under a loose prior: the fit finds 0.6."""
    truth = 0.6
    doc = _doc()
    doc["points"] = [_clock_point(mhz, (1410 / mhz) ** truth) for mhz in (1300, 1100, 900)]
    doc["prior"] = {k: {"sigma": 10.0, "why": "loose"} for k in published.FITTED}
    points = published.parse_points(yaml.safe_dump(doc), source="drawn.yaml")
    result = published.fit(sim_gpu("A100-SXM4"), points)
    assert result.after["prefill_clock_exponent"] == pytest.approx(truth, abs=0.02)
    assert result.cost_after < result.cost_before
    assert all(row["miss_fitted"] == pytest.approx(0.0, abs=0.2) for row in result.rows)


@pytest.mark.parametrize("name", ["a100-sxm4", "h100-sxm"])
def test_the_fit_never_ends_worse_and_moves_what_the_points_miss(name: str) -> None:
    """The shipped profile misses a published band (POLCA's negligible 1305 MHz on the
    A100, Splitwise's decode under 350 W on the H100); the re-fit misses it by less."""
    base, _ = profile_gpu_and_server(shipped_profile(name))
    result = published.fit(base, published.load_points())
    assert result.cost_after < result.cost_before
    worst_before = max(float(row["miss_shipped"]) for row in result.rows)  # type: ignore[arg-type]
    worst_after = max(float(row["miss_fitted"]) for row in result.rows)  # type: ignore[arg-type]
    assert worst_after < worst_before
    assert result.after != result.before


@pytest.mark.parametrize("name", ["a100-sxm4", "h100-sxm"])
def test_the_shipped_refitted_profiles_are_what_the_fit_writes(name: str) -> None:
    """``daemon/polca/data/published/<name>-published.yaml`` is up to date with the points
    (rerun ``bench/published_fit.py --write-profiles`` after editing them) and runs."""
    profile = shipped_profile(name)
    base, _ = profile_gpu_and_server(profile)
    result = published.fit(base, published.load_points())
    text = published.fitted_profile(profile, result, name=f"{profile.name}-published")
    expected = parse_profile(text, source="fit").values()
    committed = load_profile_file(REFITTED / f"{name}-published.yaml")
    assert committed.values() == expected
    gpu, _ = profile_gpu_and_server(committed)
    for key, value in result.after.items():
        assert getattr(gpu, key) == value


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["points"][0].update(low=2.0), "low end"),
        (lambda d: d["points"][0].update(kind="guess"), "kind"),
        (lambda d: d["points"][0].update(extra=1), "extra"),
        (lambda d: d["points"].append(copy.deepcopy(d["points"][0])), "unique"),
        (lambda d: d["points"][0].update(sm_clock_mhz=float("nan")), "not finite"),
        (lambda d: d["points"][0].update(sm_clock_mhz=-5), "sm_clock_mhz"),
        (lambda d: d["points"][0].update(sm_clock_mhz="1305"), "sm_clock_mhz"),
        (lambda d: d["points"][0].update(gpus=[]), "gpus"),
        (lambda d: d["prior"].pop("decode_mem_share"), "decode_mem_share"),
        (lambda d: d.update(points=[]), "points"),
    ],
)
def test_a_bad_points_file_names_the_problem(edit: object, message: str) -> None:
    doc = _doc()
    edit(doc)  # type: ignore[operator]
    with pytest.raises(SimConfigError, match="published points") as info:
        published.parse_points(yaml.safe_dump(doc), source="points.yaml")
    assert message in str(info.value)
    assert "points.yaml" in str(info.value)


def test_hostile_points_text_is_refused_before_parsing(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("#" * 140_000)
    with pytest.raises(SimConfigError, match="larger than"):
        published.load_points(big)
    with pytest.raises(SimConfigError, match="alias"):
        published.parse_points("a: &x [1]\nb: *x\n", source="alias.yaml")
    with pytest.raises(SimConfigError, match="no published point"):
        published.fit(
            dataclasses.replace(sim_gpu("A100-SXM4"), name="B300"), published.load_points()
        )


@FUZZ
@given(text=mutated(SHIPPED_POINTS.read_text()))
def test_fuzz_mutated_points_only_raise_sim_config_error(text: str) -> None:
    """A mutated points file loads (bands ordered, ids unique) or is a SimConfigError."""
    try:
        points = published.parse_points(text, source="fuzz.yaml")
    except SimConfigError:
        return
    gpu = sim_gpu("A100-SXM4")
    for point in points.points:
        assert published.miss(point, published.predict(gpu, point)) >= 0.0


def test_the_plot_is_drawn(tmp_path: Path) -> None:
    from polca.sim.plots import published_plot

    points = published.load_points()
    fits = []
    for name in ("a100-sxm4", "h100-sxm"):
        base, _ = profile_gpu_and_server(shipped_profile(name))
        after = published.fit(base, points).after
        fitted = dataclasses.replace(base, **dict[str, Any](after))
        fits.append((base, fitted, points.for_gpu(base.name)))
    path = tmp_path / "fit.png"
    published_plot(path, fits)
    assert path.stat().st_size > 10_000
