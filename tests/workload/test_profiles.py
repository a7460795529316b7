"""Load profiles of the simulated GPUs: shapes, validation, determinism, settings names."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from polca.workload.profiles import (
    ConstantLoad,
    InferenceLoad,
    LoadProfile,
    RampLoad,
    ScriptedLoad,
    SquareLoad,
    load_profile,
)


def test_ramp_and_square_profiles() -> None:
    """Ramp rises linearly over its period; square alternates high then low."""
    ramp = RampLoad(period_s=10.0, repeat=False)
    assert [ramp.utilization(t, 0) for t in (0.0, 2.5, 10.0, 50.0)] == [0.0, 0.25, 1.0, 1.0]
    assert RampLoad(period_s=10.0).utilization(12.5, 0) == pytest.approx(0.25)
    square = SquareLoad(period_s=4.0, low=0.2, high=0.9)
    assert [square.utilization(t, 0) for t in (0.0, 1.9, 2.1, 4.5)] == [0.9, 0.9, 0.2, 0.9]


def test_scripted_profile_interpolates_and_holds() -> None:
    """A scripted trace interpolates between points and holds before and after them."""
    script = ScriptedLoad(((10.0, 0.0), (20.0, 1.0), (30.0, 0.5)))
    assert [script.utilization(t, 0) for t in (0.0, 15.0, 20.0, 25.0, 99.0)] == [
        0.0,
        0.5,
        1.0,
        0.75,
        0.5,
    ]
    stepped = ScriptedLoad([(0.0, 0.1), (5.0, 0.8)], interpolate=False)
    assert stepped.points == ((0.0, 0.1), (5.0, 0.8))
    assert stepped.utilization(4.9, 0) == 0.1
    with pytest.raises(ValueError, match="must not decrease"):
        ScriptedLoad(((5.0, 0.1), (1.0, 0.2)))
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        ScriptedLoad(((0.0, 1.5),))


def test_inference_profile_has_decode_floor_and_prefill_bursts() -> None:
    """Inference load decodes at 57-73 % and spends some time in prefill bursts near 100 %."""
    profile = InferenceLoad()
    values = [profile.utilization(i * 0.05, 12345) for i in range(20_000)]
    bursts = sum(v >= 0.95 for v in values) / len(values)
    assert 0.05 < bursts < 0.35
    decode = [v for v in values if v < 0.95]
    assert min(decode) >= 0.57
    assert max(decode) <= 0.73


def test_load_profile_names() -> None:
    """Settings names map to profiles; unknown names and bad arguments are explained."""
    assert load_profile("idle") == ConstantLoad(0.0)
    assert load_profile("constant:0.25") == ConstantLoad(0.25)
    assert load_profile("Ramp:30") == RampLoad(period_s=30.0)
    assert load_profile("square") == SquareLoad()
    assert isinstance(load_profile("inference"), InferenceLoad)
    with pytest.raises(ValueError, match="unknown load profile 'training'"):
        load_profile("training")
    with pytest.raises(ValueError, match="invalid load profile"):
        load_profile("constant:2")


def test_inference_profile_repeats_per_stream_and_differs_between_streams() -> None:
    """Inference load is a pure function of (time, stream): same stream, same trace."""
    times_s = [i * 0.25 for i in range(400)]
    first = [InferenceLoad().utilization(t, 7) for t in times_s]
    again = [InferenceLoad().utilization(t, 7) for t in times_s]
    other = [InferenceLoad().utilization(t, 8) for t in times_s]
    assert first == again
    assert first != other


@pytest.mark.parametrize(
    "build",
    [
        lambda: ConstantLoad(-0.1),
        lambda: RampLoad(period_s=0.0),
        lambda: RampLoad(high=1.5),
        lambda: SquareLoad(duty=2.0),
        lambda: ScriptedLoad(()),
    ],
)
def test_invalid_profile_arguments_are_rejected(build: Callable[[], object]) -> None:
    """Utilizations outside 0..1, non-positive periods and empty scripts raise ValueError."""
    with pytest.raises(ValueError, match=r"within 0\.\.1|positive|at least one"):
        build()


def test_every_profile_satisfies_the_protocol() -> None:
    """Each profile class is a ``LoadProfile``, and one is passed through unchanged."""
    profiles: list[LoadProfile] = [
        ConstantLoad(),
        InferenceLoad(),
        RampLoad(),
        SquareLoad(),
        ScriptedLoad(((0.0, 0.5),)),
    ]
    assert all(isinstance(p, LoadProfile) for p in profiles)
    assert all(load_profile(p) is p for p in profiles)
