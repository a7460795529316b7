"""`polca policy check` and `polca policy schema`, driven through their stream API."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from polca.errors import PolicyError
from polca.policy import parse_policy, policy_json_schema
from polca.policy.check import run_check, run_schema
from tests.cpu import cpu_budget_s
from tests.policy.conftest import BASE_YAML

WritePolicy = Callable[..., Path]


def test_valid_file_prints_ok_with_revision(write_policy: WritePolicy) -> None:
    """A valid file gives exit 0 and `FILE: ok (revision ...)` on out, nothing on err."""
    path = write_policy(BASE_YAML)
    out, err = io.StringIO(), io.StringIO()
    assert run_check([path], out=out, err=err) == 0
    assert out.getvalue().startswith(f"{path}: ok (revision ")
    assert "policy test, levels T1@80%, T2@89%" in out.getvalue()
    assert err.getvalue() == ""


def test_invalid_files_print_problems(write_policy: WritePolicy, tmp_path: Path) -> None:
    """Problems go to err one per line, valid files still print ok, and the exit is 1."""
    good = write_policy(BASE_YAML, "good.yaml")
    bad = write_policy(BASE_YAML.replace("threshold_pct: 89", "threshold_pct: 70"), "bad.yaml")
    missing = tmp_path / "missing.yaml"
    out, err = io.StringIO(), io.StringIO()
    assert run_check([bad, good, missing], out=out, err=err) == 1
    lines = err.getvalue().splitlines()
    assert lines[0].startswith(f"{bad}:11:20: levels[1].threshold_pct: thresholds must ascend")
    assert lines[1].startswith(f"{missing}:1:1: cannot read policy file")
    assert len(lines) == 2
    assert out.getvalue().startswith(f"{good}: ok")


def test_no_files_is_a_usage_error() -> None:
    """Calling check without files exits 2."""
    err = io.StringIO()
    assert run_check([], out=io.StringIO(), err=err) == 2
    assert "no policy file" in err.getvalue()


def test_schema_prints_json_schema() -> None:
    """`polca policy schema` prints the JSON Schema."""
    out = io.StringIO()
    assert run_schema(out) == 0
    schema = json.loads(out.getvalue())
    assert schema == policy_json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False
    assert "CapSpec" in schema["$defs"]


# 322 bytes: seven anchors of nine aliases each, 9**7 "lol"s and twice that once expanded.
ALIAS_BOMB = (
    "# billion laughs ....................\n"
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(
        f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True)
    )
    + "h: [*g, *g]\n"
)


def test_hostile_yaml_is_a_problem_not_a_crash(write_policy: WritePolicy) -> None:
    """A 4 kB nested file and a 322-byte alias bomb print FILE:LINE:COL, exit 1, quickly."""
    nested = write_policy("name: " + "[" * 2000 + "]" * 2000 + "\n", "nested.yaml")
    bomb = write_policy(ALIAS_BOMB, "bomb.yaml")
    assert len(bomb.read_bytes()) == 322
    assert len(nested.read_bytes()) == 4007
    out, err = io.StringIO(), io.StringIO()
    start = time.process_time()  # this process's CPU, whatever else the machine runs
    assert run_check([nested, bomb], out=out, err=err) == 1
    assert time.process_time() - start < cpu_budget_s(2.0)  # was 4 s for the bomb alone
    assert err.getvalue().splitlines() == [
        f"{nested}:1:70: YAML nested deeper than 64 levels",
        f"{bomb}:7:4: YAML expands (aliases counted as copies) to more than 2000000 nodes "
        "and characters",
    ]
    assert out.getvalue() == ""


def test_oversized_policy_file_is_refused_before_parsing(write_policy: WritePolicy) -> None:
    """A policy file over the YAML size bound is one problem at 1:1, read only that far."""
    path = write_policy("# " + "x" * (2 * 1024 * 1024) + "\n" + BASE_YAML)
    out, err = io.StringIO(), io.StringIO()
    assert run_check([path], out=out, err=err) == 1
    assert err.getvalue() == f"{path}:1:1: YAML larger than 65536 bytes\n"
    with pytest.raises(PolicyError, match="larger than 65536 bytes"):
        parse_policy("# " + "x" * 70_000 + "\n" + BASE_YAML, source="mqtt:p")
