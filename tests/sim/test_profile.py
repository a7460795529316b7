"""GPU/server profiles: the shipped files are the presets, every constant has a source, a
hostile or impossible profile is a clear error, and a profile changes what a run computes."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given

from polca.physics.presets import get_model
from polca.policy import Policy
from polca.sim.model import SERVER_PRESETS, SIM_GPUS, SimConfigError, profile_gpu_and_server
from polca.sim.profile import (
    GpuProfile,
    ServerProfile,
    dump_profile,
    load_profile_file,
    parse_profile,
    resolve_profile,
    shipped_profile,
    shipped_profile_names,
)
from polca.sim.scenario import simulate
from polca.sim.workload import load_trace
from polca.workload.serving import serving_model
from tests.fuzzing import FUZZ, mutated
from tests.sim.conftest import tiny_scenario

SHIPPED = shipped_profile_names()


def _text(name: str = "a100-sxm4") -> str:
    return (
        Path(__file__).resolve().parents[2] / "daemon/polca/data/profiles" / f"{name}.yaml"
    ).read_text()


def test_every_preset_comes_from_a_shipped_profile() -> None:
    """SIM_GPUS and SERVER_PRESETS are exactly the shipped profiles (no second home)."""
    assert SHIPPED == ("a100-sxm4", "a100-sxm4-40gb", "h100-sxm", "h200-sxm")
    for name in SHIPPED:
        gpu, server = profile_gpu_and_server(shipped_profile(name))
        assert SIM_GPUS[name] == gpu
        assert SERVER_PRESETS[name] == server


@pytest.mark.parametrize("name", SHIPPED)
def test_every_constant_has_a_source(name: str) -> None:
    """Each of the model's constants is in the file with a source line."""
    profile = shipped_profile(name)
    fields = {f.name for f in dataclasses.fields(SIM_GPUS[name])} - {"name"}
    assert set(GpuProfile.model_fields) == fields
    assert set(ServerProfile.model_fields) == {
        f.name for f in dataclasses.fields(SERVER_PRESETS[name])
    } - {"gpu"}
    for section in (profile.gpu, profile.server):
        for key in type(section).model_fields:
            assert len(getattr(section, key).source) > 10, (name, key)


@pytest.mark.parametrize("name", SHIPPED)
def test_hardware_figures_agree_with_the_gpu_and_serving_presets(name: str) -> None:
    """Figures the simulated backend and the replay also use are the same in both places."""
    gpu = SIM_GPUS[name]
    model = get_model(gpu.name)
    assert (gpu.tdp_w, gpu.power_limit_min_w, gpu.power_limit_max_w) == (
        model.tdp_w,
        model.power_limit_min_w,
        model.power_limit_max_w,
    )
    assert (gpu.sm_clock_max_mhz, gpu.sm_clock_min_mhz) == (
        model.sm_clock_max_mhz,
        model.sm_clock_min_mhz,
    )
    assert gpu.clock_power_exponent == model.clock_power_exponent
    assert gpu.prefill_mem_share == model.mem_power_share
    serving = serving_model(gpu.name)
    assert gpu.prefill_tokens_per_s == serving.prefill_tokens_per_s
    assert gpu.decode_s_per_token == serving.decode_s_per_token


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["gpu"].pop("tdp_w"), "gpu.tdp_w"),
        (lambda d: d["gpu"].update(turbo={"value": 1, "source": "marketing"}), "turbo"),
        (lambda d: d["gpu"]["tdp_w"].pop("source"), "source"),
        (lambda d: d["gpu"]["tdp_w"].update(value=-400), "tdp_w: -400"),
        (lambda d: d["gpu"]["tdp_w"].update(value="400"), "value"),
        (lambda d: d["gpu"]["tdp_w"].update(value=True), "value"),
        (lambda d: d["gpu"]["sm_clock_max_mhz"].update(value=1410.5), "whole number"),
        (lambda d: d["gpu"]["sm_clock_min_mhz"].update(value=1500), "must not exceed"),
        (lambda d: d["gpu"]["decode_mem_share"].update(value=1.5), "decode_mem_share"),
        (lambda d: d["server"]["load_scale"].update(value=0), "load_scale"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.update(name="a b/c"), "name"),
    ],
)
def test_a_bad_profile_names_the_field(edit: object, message: str) -> None:
    """Missing, unknown, mistyped, out of range or disordered: SimConfigError naming it."""
    data = yaml.safe_load(_text())
    edit(data)  # type: ignore[operator]
    with pytest.raises(SimConfigError, match="invalid") as info:
        parse_profile(yaml.safe_dump(data), source="site.yaml")
    assert message in str(info.value)
    assert "site.yaml" in str(info.value)


def test_hostile_text_is_refused_before_parsing(tmp_path: Path) -> None:
    """Too large, aliases, not YAML, not UTF-8, no file: clear errors, nothing else."""
    big = tmp_path / "big.yaml"
    big.write_text("#" * 70_000)
    with pytest.raises(SimConfigError, match="larger than"):
        load_profile_file(big)
    with pytest.raises(SimConfigError, match="alias"):
        parse_profile("a: &x [1]\nb: *x\n", source="alias.yaml")
    with pytest.raises(SimConfigError, match="invalid"):
        parse_profile("[1, 2, 3]", source="list.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SimConfigError, match="UTF-8"):
        load_profile_file(latin)
    with pytest.raises(SimConfigError, match="no shipped profile"):
        resolve_profile("b300")
    with pytest.raises(SimConfigError, match="cannot read"):
        resolve_profile(str(tmp_path / "missing.yaml"))


def test_dump_writes_what_loads_back(tmp_path: Path) -> None:
    """A written profile (what a calibration writes) parses back to the same values."""
    gpu, server = shipped_profile("h100-sxm").values()
    gpu["decode_clock_exponent"] = 0.1
    text = dump_profile("H100-site", gpu, server, sources={"decode_clock_exponent": "swept here"})
    path = tmp_path / "site.yaml"
    path.write_text(text)
    loaded = resolve_profile(str(path))
    assert loaded.values() == (gpu, server)
    assert loaded.gpu.decode_clock_exponent.source == "swept here"
    assert loaded.gpu.tdp_w.source.startswith("default")


def test_a_profile_changes_the_run(a100_policy: Policy, tmp_path: Path) -> None:
    """The shipped profile reproduces the default run; a less clock-sensitive prefill
    (a site's calibration) lowers the time-to-first-token impact of the same caps."""
    trace = load_trace("azure-code")
    s = tiny_scenario(oversubscription=0.5)
    _, _, default = simulate(s, trace, a100_policy)
    _, _, same = simulate(replace(s, profile="a100-sxm4"), trace, a100_policy)
    assert same["metrics"] == default["metrics"]
    data = yaml.safe_load(_text())
    data["name"] = "A100-site"
    data["gpu"]["prefill_clock_exponent"]["value"] = 0.3
    path = tmp_path / "a100-site.yaml"
    path.write_text(yaml.safe_dump(data))
    _, _, site = simulate(replace(s, profile=str(path)), trace, a100_policy)
    assert site["row"]["gpu"] == "A100-site"
    assert site["row"]["profile"] == str(path)
    hp = default["metrics"]["classes"]["high"]
    hp_site = site["metrics"]["classes"]["high"]
    assert hp_site["ttft_p99_impact_pct"] < hp["ttft_p99_impact_pct"]


@FUZZ
@given(text=mutated(_text()))
def test_fuzz_mutated_profiles_only_raise_sim_config_error(text: str) -> None:
    """A mutated shipped profile loads (every value in range) or is a SimConfigError."""
    try:
        profile = parse_profile(text, source="fuzz.yaml")
    except SimConfigError:
        return
    gpu, server = profile_gpu_and_server(profile)
    assert gpu.sm_clock_min_mhz <= gpu.brake_sm_clock_mhz <= gpu.sm_clock_max_mhz
    assert gpu.power_limit_min_w <= gpu.tdp_w <= gpu.power_limit_max_w
    assert server.load_scale > 0
