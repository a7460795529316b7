"""Fuzz the policy decoder: mutated policies give a policy or a PolicyError, nothing else."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from polca.errors import PolicyError
from polca.policy import Policy, parse_policy
from tests.fuzzing import FUZZ, mutated
from tests.policy.conftest import BASE_YAML

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "policies").glob("*.yaml"))
TEXTS = [BASE_YAML, *(path.read_text(encoding="utf-8") for path in SHIPPED)]


def old_decoder(text: str) -> Policy | None:
    """What the loader accepted before bounds: safe_load then validate (None if refused)."""
    try:
        return Policy.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValidationError):
        return None


@FUZZ
@given(text=st.sampled_from(TEXTS).flatmap(mutated))
def test_fuzz_mutated_policies_only_raise_policy_error(text: str) -> None:
    """Any mutation of a valid policy decodes as before, or is a PolicyError with places."""
    try:
        loaded = parse_policy(text, source="fuzz.yaml")
    except PolicyError as exc:
        problems = exc.problems
    else:
        assert loaded.policy == old_decoder(text)
        return
    assert problems
    assert all(p.startswith("fuzz.yaml:") for p in problems)
    assert all(p.split(":")[1].isdigit() and p.split(":")[2].isdigit() for p in problems)


def test_valid_policies_decode_as_before() -> None:
    """The shipped policies and the fixture decode to what safe_load and pydantic give."""
    for text in TEXTS:
        assert parse_policy(text, source="ok.yaml").policy == old_decoder(text)
