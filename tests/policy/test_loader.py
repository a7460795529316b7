"""The loader: FILE:LINE:COL problems, revisions, and keeping the last good policy."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from structlog.testing import capture_logs

from polca.errors import PolicyError
from polca.policy import PolicyStore, check_files, load_policy, parse_policy
from polca.policy.loader import MAX_PROBLEMS
from polca.yamlkit import YamlError
from tests.policy.conftest import BASE_YAML

WritePolicy = Callable[..., Path]


def broken(old: str, new: str) -> str:
    """BASE_YAML with one exact substring replaced (which must exist)."""
    assert old in BASE_YAML
    return BASE_YAML.replace(old, new, 1)


def test_base_yaml_loads(write_policy: WritePolicy) -> None:
    """The YAML fixture is valid, and the result records path, text and revision."""
    path = write_policy(BASE_YAML)
    loaded = load_policy(path)
    assert loaded.policy.name == "test"
    assert loaded.path == path
    assert loaded.source == str(path)
    assert loaded.text == BASE_YAML
    assert loaded.revision == hashlib.sha256(BASE_YAML.encode()).hexdigest()[:12]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            broken("classes: [high, low]", "classes: [high, low"),
            ["4:14: YAML syntax: while parsing a flow sequence expected ',' or ']', but got ':'"],
            id="yaml-syntax",
        ),
        pytest.param(
            broken("low: {sm_clock_max_mhz: 1275}", "low: {sm_clock_max_mhz: 1275, colour: red}"),
            ["9:37: levels[0].caps.low: unknown key 'colour'"],
            id="unknown-key",
        ),
        pytest.param(
            broken("threshold_pct: 89", "threshold_pct: high"),
            ["11:20: levels[1].threshold_pct: Input should be a valid number"],
            id="wrong-type",
        ),
        pytest.param(
            broken("threshold_pct: 89", "threshold_pct: 70"),
            [
                "11:20: levels[1].threshold_pct: thresholds must ascend strictly: "
                "'T2' (70%) is not above 'T1' (80%)"
            ],
            id="thresholds-out-of-order",
        ),
        pytest.param(
            broken("low: {sm_clock_max_mhz: 1110}", "low: {sm_clock_max_mhz: 1300}"),
            [
                "13:31: levels[1].caps.low.sm_clock_max_mhz: sm_clock_max_mhz 1300 for class "
                "'low' at 'T2' loosens 1275 at 'T1'; a higher level must never loosen a cap"
            ],
            id="loosening-cap",
        ),
        pytest.param(
            broken("high: {sm_clock_max_mhz: 1305}", "hgh: {sm_clock_max_mhz: 1305}"),
            ["14:7: levels[1].caps.hgh: class 'hgh' is not declared in classes (high, low)"],
            id="undeclared-class",
        ),
        pytest.param(
            broken("sm_clock_max_pct: 75", "sm_clock_max_pct: 175"),
            [
                "19:30: thermal_guards[0].caps.sm_clock_max_pct: "
                "Input should be less than or equal to 100"
            ],
            id="pct-over-100",
        ),
        pytest.param(
            broken("default_class: low\n", ""),
            ["1:1: missing required key 'default_class'"],
            id="missing-key",
        ),
        pytest.param(
            BASE_YAML + "name: again\n",
            ["23:1: duplicate key 'name'"],
            id="duplicate-key",
        ),
        pytest.param(
            broken("release_gpu_temp_c: 80", "release_gpu_temp_c: 90"),
            [
                "18:25: thermal_guards[0].release_gpu_temp_c: release_gpu_temp_c (90) "
                "must be below gpu_temp_c (85)"
            ],
            id="release-above-trigger",
        ),
        pytest.param("", ["1:1: the policy is empty"], id="empty"),
        pytest.param("- a\n- b\n", ["1:1: expected a mapping (key: value)"], id="not-a-mapping"),
        pytest.param(
            BASE_YAML + "---\nname: second\n",
            [
                "23:1: YAML syntax: expected a single document in the stream "
                "but found another document"
            ],
            id="two-documents",
        ),
    ],
)
def test_broken_file_problems(write_policy: WritePolicy, text: str, expected: list[str]) -> None:
    """Each kind of mistake is reported once, as FILE:LINE:COL: message."""
    path = write_policy(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert list(info.value.problems) == [f"{path}:{line}" for line in expected]
    assert check_files([path]) == [f"{path}:{line}" for line in expected]


def test_problems_are_sorted_by_position(write_policy: WritePolicy) -> None:
    """Several problems come back together, in file order."""
    text = broken("threshold_pct: 89", "threshold_pct: 70")
    text = text.replace("default_class: low", "default_class: lo")
    text = text.replace("low: {sm_clock_max_mhz: 1110}\n", "lw: {sm_clock_max_mhz: 1110}\n")
    path = write_policy(text)
    problems = check_files([path])
    positions = [tuple(int(n) for n in p.split(":")[1:3]) for p in problems]
    assert positions == sorted(positions)
    assert len(problems) == 5, problems  # "lw" replaced twice: T2 and fail_safe


def test_missing_file_is_a_problem(tmp_path: Path) -> None:
    """An unreadable file is reported at 1:1 and chained to the OSError."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.problems[0].startswith(f"{path}:1:1: cannot read policy file")
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_non_utf8_file_is_a_problem(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are a 1:1 problem, not a crash."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.problems[0].startswith(f"{path}:1:1: policy file")
    assert "not UTF-8" in info.value.problems[0]


def test_check_files_collects_every_file(write_policy: WritePolicy) -> None:
    """check_files reports all problems of all files, and nothing for valid ones."""
    good = write_policy(BASE_YAML, "good.yaml")
    bad1 = write_policy(broken("threshold_pct: 89", "threshold_pct: x"), "bad1.yaml")
    bad2 = write_policy("name: [\n", "bad2.yaml")
    problems = check_files([good, bad1, bad2])
    assert [p.split(":")[0] for p in problems] == [str(bad1), str(bad2)]
    assert check_files([good]) == []


def test_parse_policy_uses_source_in_problems() -> None:
    """Policies received as text name their source instead of a file."""
    loaded = parse_policy(BASE_YAML, source="mqtt:polca/v1/site/policy")
    assert loaded.path is None
    assert loaded.source == "mqtt:polca/v1/site/policy"
    assert loaded.revision == hashlib.sha256(BASE_YAML.encode()).hexdigest()[:12]
    with pytest.raises(PolicyError) as info:
        parse_policy(broken("threshold_pct: 89", "threshold_pct: 70"), source="mqtt:x")
    assert info.value.problems[0].startswith("mqtt:x:11:20: ")


def test_yaml_error_is_chained(write_policy: WritePolicy) -> None:
    """PolicyError keeps the YAML or pydantic error as its cause (YAML's via YamlError)."""
    with pytest.raises(PolicyError) as info:
        load_policy(write_policy("a: [\n"))
    assert isinstance(info.value.__cause__, YamlError)
    assert isinstance(info.value.__cause__.__cause__, yaml.YAMLError)
    with pytest.raises(PolicyError) as info:
        load_policy(write_policy(broken("threshold_pct: 89", "threshold_pct: 70")))
    assert isinstance(info.value.__cause__, ValidationError)


def test_store_keeps_last_good_policy(write_policy: WritePolicy) -> None:
    """A failed reload keeps the previous policy in force and reports the problems."""
    path = write_policy(BASE_YAML)
    store = PolicyStore(path)
    assert store.current is None  # no I/O before reload()

    with capture_logs() as logs:
        first = store.reload()
    assert first.ok
    assert first.changed
    assert first.loaded is not None
    assert first.loaded is store.current
    assert logs[-1]["event"] == "policy_loaded"
    assert logs[-1]["revision"] == first.loaded.revision

    same = store.reload()
    assert same.ok
    assert not same.changed

    path.write_text(broken("threshold_pct: 89", "threshold_pct: 70"), encoding="utf-8")
    with capture_logs() as logs:
        failed = store.reload()
    assert not failed.ok
    assert not failed.changed
    assert failed.loaded is first.loaded
    assert store.current is first.loaded
    assert failed.errors[0].startswith(f"{path}:11:20: ")
    assert logs == [
        {
            "event": "policy_reload_failed",
            "log_level": "warning",
            "source": str(path),
            "problems": list(failed.errors),
            "kept_revision": first.loaded.revision,
        }
    ]

    path.write_text(BASE_YAML.replace("name: test", "name: test2"), encoding="utf-8")
    fixed = store.reload()
    assert fixed.ok
    assert fixed.changed
    assert fixed.loaded is not None
    assert fixed.loaded.policy.name == "test2"


def test_store_without_good_policy(tmp_path: Path) -> None:
    """With no valid file ever read, a failed reload leaves nothing in force."""
    store = PolicyStore(tmp_path / "missing.yaml")
    result = store.reload()
    assert not result.ok
    assert result.loaded is None
    assert store.current is None


def test_load_first_reads_once_and_refuses_a_start_without_a_policy(
    write_policy: WritePolicy, tmp_path: Path
) -> None:
    """A daemon's start-up: the file is read when nothing is in force yet, what is in force
    is kept (a later bad file does not matter until a reload), and no valid policy at all
    is a ``PolicyError`` naming the file and its problems."""
    path = write_policy(BASE_YAML)
    store = PolicyStore(path)
    first = store.load_first()
    assert first is store.current
    path.write_text(broken("threshold_pct: 89", "threshold_pct: 70"), encoding="utf-8")
    assert store.load_first() is first
    missing = tmp_path / "missing.yaml"
    with pytest.raises(PolicyError) as info:
        PolicyStore(missing).load_first()
    assert str(info.value).startswith(f"policy {missing} is invalid: ")
    assert info.value.problems


def test_store_replace_from_text(write_policy: WritePolicy) -> None:
    """A policy pushed as text replaces the file's when valid, and is refused otherwise."""
    store = PolicyStore(write_policy(BASE_YAML))
    store.reload()
    pushed = store.replace(BASE_YAML.replace("name: test", "name: pushed"), source="mqtt:p")
    assert pushed.changed
    assert store.current is not None
    assert store.current.policy.name == "pushed"
    assert store.current.source == "mqtt:p"
    refused = store.replace("name: [", source="mqtt:p")
    assert not refused.ok
    assert refused.errors[0].startswith("mqtt:p:")
    assert store.current.policy.name == "pushed"


def test_text_with_a_lone_surrogate_is_a_problem() -> None:
    """Text that is not valid Unicode (a JSON "\\ud800" escape) is a 1:1 problem, no crash."""
    with pytest.raises(PolicyError) as info:
        parse_policy(BASE_YAML + "# \ud800\n", source="mqtt:x")
    assert info.value.problems[0].startswith("mqtt:x:1:1: ")
    assert "not valid Unicode" in info.value.problems[0]


def test_merge_keys_may_be_overridden() -> None:
    """A key after a merge key overrides the merged one: not a duplicate."""
    text = broken("low: {sm_clock_max_mhz: 1275}", "low: &c {sm_clock_max_mhz: 1275}")
    head, tail = text.rsplit("low: {sm_clock_max_mhz: 1110}", 1)
    text = head + "low: {<<: *c, sm_clock_max_mhz: 1110}" + tail
    loaded = parse_policy(text, source="merge.yaml")
    assert loaded.policy == parse_policy(BASE_YAML, source="base.yaml").policy


def test_problems_are_capped(write_policy: WritePolicy) -> None:
    """Thousands of problems are cut to MAX_PROBLEMS and a line saying how many more."""
    extra = "".join(f"unknown_{i}: 1\n" for i in range(MAX_PROBLEMS + 50))
    with pytest.raises(PolicyError) as info:
        load_policy(write_policy(BASE_YAML + extra))
    problems = info.value.problems
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1].endswith(": ... and 50 more problems")


def test_the_policy_in_force_is_the_last_good_one_or_an_error(tmp_path: Path) -> None:
    """``in_force`` raises until a valid file was read, then keeps it through a bad one."""
    path = tmp_path / "policy.yaml"
    path.write_text("not: [a policy\n", encoding="utf-8")
    store = PolicyStore(path)
    store.reload()
    with pytest.raises(PolicyError, match="no valid policy loaded"):
        _ = store.in_force
    shipped = Path(__file__).resolve().parents[2] / "policies" / "polca-a100.yaml"
    path.write_text(shipped.read_text(encoding="utf-8"), encoding="utf-8")
    store.reload()
    good = store.in_force
    path.write_text("not: [a policy\n", encoding="utf-8")
    store.reload()
    assert store.in_force is good
