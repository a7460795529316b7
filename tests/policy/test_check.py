"""`polca policy check` and `polca policy schema`, driven through their stream API."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

from polca.policy import policy_json_schema
from polca.policy.check import run_check, run_schema
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
