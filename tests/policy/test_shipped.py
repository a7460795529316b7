"""The shipped policies and docs/policy.md: valid, faithful to POLCA, schema in sync."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from polca.policy import (
    ControlInput,
    EngineState,
    GpuView,
    Policy,
    decide,
    load_policy,
    parse_policy,
    policy_json_schema,
)
from polca.policy.check import run_check
from polca.policy.schema import BEGIN_MARKER, embedded_schema, with_schema
from polca.policy.schema_export import main as schema_export_main

REPO = Path(__file__).resolve().parents[2]
POLICIES = sorted((REPO / "policies").glob("*.yaml"))
DOC = REPO / "docs" / "policy.md"


def gpu(index: int, *, sm_clock_max_mhz: int, power_limit_default_mw: int) -> GpuView:
    """A cool GPU with the given maxima and a permissive lowest clock."""
    return GpuView(
        index=index,
        uuid=f"GPU-{index}",
        priority_class=None,
        gpu_temp_c=40.0,
        mem_temp_c=40.0,
        sm_clock_max_mhz=sm_clock_max_mhz,
        sm_clock_min_mhz=200,
        power_limit_min_mw=100_000,
        power_limit_max_mw=power_limit_default_mw,
        power_limit_default_mw=power_limit_default_mw,
    )


def clocks_by_level(policy: Policy, gpus: list[GpuView]) -> list[list[int | None]]:
    """SM clock caps of ``gpus`` at each level, nominal first."""
    out = []
    for level in range(policy.top_level + 1):
        control = ControlInput(level=level, lease_expires_ns=2)
        decision = decide(gpus, policy=policy, control=control, state=EngineState(), now_ns=1)
        out.append([t.sm_clock_max_mhz for t in decision.targets])
    return out


def test_expected_policies_are_shipped() -> None:
    """The three documented policies exist."""
    names = {path.stem for path in POLICIES}
    assert {"polca-a100", "polca-h100", "simulated-demo"} <= names


@pytest.mark.parametrize("path", POLICIES, ids=[p.name for p in POLICIES])
def test_shipped_policy_is_valid(path: Path) -> None:
    """Every file in policies/ loads, is named after its file, and has thermal guards."""
    loaded = load_policy(path)
    assert loaded.policy.name == path.stem
    assert loaded.policy.thermal_guards
    assert loaded.policy.fail_safe.caps


def test_a100_policy_is_polca_as_published() -> None:
    """A100: T1 80% -> low 1275; T2 89% -> low 1110, high 1305; brake 288; margin 5."""
    policy = load_policy(REPO / "policies" / "polca-a100.yaml").policy
    assert [lvl.threshold_pct for lvl in policy.levels] == [80, 89, 98]
    assert policy.release.margin_pct == 5
    assert policy.release.one_level_at_a_time
    assert policy.classes == ("high", "low")
    high = GpuView(0, "GPU-h", "high", 40.0, 40.0, 1410, 210, 100_000, 400_000, 400_000)
    low = GpuView(1, "GPU-l", "low", 40.0, 40.0, 1410, 210, 100_000, 400_000, 400_000)
    assert clocks_by_level(policy, [high, low]) == [
        [None, None],
        [None, 1275],
        [1305, 1110],
        [288, 288],
    ]


def test_h100_policy_scales_a100_points() -> None:
    """H100/H200: the A100 points as % of max clock (90, 79, 93, 20) on 1980 MHz."""
    policy = load_policy(REPO / "policies" / "polca-h100.yaml").policy
    high = GpuView(0, "GPU-h", "high", 40.0, 40.0, 1980, 210, 200_000, 700_000, 700_000)
    low = GpuView(1, "GPU-l", "low", 40.0, 40.0, 1980, 210, 200_000, 700_000, 700_000)
    assert clocks_by_level(policy, [high, low]) == [
        [None, None],
        [None, 1782],
        [1841, 1564],
        [396, 396],
    ]


def test_demo_policy_assigns_eight_gpus() -> None:
    """Demo: GPUs 0-3 high, 4-7 low, and a dwell short enough to watch."""
    policy = load_policy(REPO / "policies" / "simulated-demo.yaml").policy
    classes = [policy.static_class(index=i, uuid=f"GPU-{i}") for i in range(8)]
    assert classes == ["high"] * 4 + ["low"] * 4
    assert policy.release.dwell_s <= 5
    gpus = [gpu(i, sm_clock_max_mhz=1980, power_limit_default_mw=700_000) for i in range(8)]
    assert clocks_by_level(policy, gpus)[1] == [None] * 4 + [1782] * 4


def test_check_command_accepts_shipped_policies() -> None:
    """`polca policy check policies/*.yaml` exits 0."""
    out, err = io.StringIO(), io.StringIO()
    assert run_check(POLICIES, out=out, err=err) == 0
    assert err.getvalue() == ""
    assert out.getvalue().count(": ok (revision ") == len(POLICIES)


def test_doc_schema_is_current() -> None:
    """The schema embedded in docs/policy.md equals policy_json_schema()."""
    document = DOC.read_text(encoding="utf-8")
    assert embedded_schema(document) == policy_json_schema()
    assert with_schema(document) == document  # also byte-identical to the generator


def test_doc_yaml_examples_are_valid() -> None:
    """Every complete policy example in docs/policy.md validates."""
    document = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", document, re.DOTALL)
    complete = [block for block in blocks if "schema_version:" in block]
    assert complete
    for block in complete:
        parse_policy(block, source="docs/policy.md")


def test_doc_check_example_is_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `polca policy check` output quoted in docs/policy.md is what polca prints."""
    document = DOC.read_text(encoding="utf-8")
    example = re.search(r"## A complete example\n\n```yaml\n(.*?)```", document, re.DOTALL)
    quoted = re.search(r"\$ polca policy check broken.yaml\n(.*?)```", document, re.DOTALL)
    assert example is not None
    assert quoted is not None
    text = (
        example.group(1)
        .replace("threshold_pct: 89", "threshold_pct: 70")
        .replace(
            "low: {sm_clock_max_mhz: 1110}\n      high", "low: {sm_clock_max_mhz: 1300}\n      high"
        )
        .replace(
            "      high: {sm_clock_max_mhz: 288}",
            "      high: {sm_clock_max_mhz: 288}\n      batch: {sm_clock_max_mhz: 288}",
        )
    )
    (tmp_path / "broken.yaml").write_text(text, encoding="utf-8")
    err = io.StringIO()
    monkeypatch.chdir(tmp_path)  # the quoted output names the file relative to the cwd
    assert run_check([Path("broken.yaml")], out=io.StringIO(), err=err) == 1
    assert err.getvalue() == quoted.group(1)


def test_schema_export_rewrites_and_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """schema_export fixes a stale block, and --check reports stale (1) or current (0)."""
    stale = tmp_path / "policy.md"
    stale.write_text(f"# t\n\n{BEGIN_MARKER}\n```json\n{{}}\n```\n<!-- END SCHEMA -->\nend\n")
    assert schema_export_main(["--check", str(stale)]) == 1
    assert schema_export_main([str(stale)]) == 0
    assert embedded_schema(stale.read_text()) == policy_json_schema()
    assert stale.read_text().endswith("<!-- END SCHEMA -->\nend\n")
    assert schema_export_main(["--check", str(stale)]) == 0
    assert schema_export_main([]) == 2
    assert "out of date" in capsys.readouterr().err


def test_embedded_schema_needs_markers() -> None:
    """A document without the markers is an error, not an empty schema."""
    with pytest.raises(ValueError, match="BEGIN SCHEMA"):
        embedded_schema("# no schema here\n")


def test_shipped_production_policies_stop_at_the_fail_safe() -> None:
    """Every shipped production policy leaves fail-safe caps at a stop; the demo restores."""
    for path in sorted((REPO / "policies").glob("*.yaml")):
        policy = load_policy(path).policy
        expected = "restore" if path.name == "simulated-demo.yaml" else "fail_safe"
        assert policy.on_stop == expected, path.name
        assert policy.fail_safe.caps, path.name  # a fail-safe that caps something
