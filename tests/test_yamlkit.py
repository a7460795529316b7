"""Bounded YAML: every bound, every hostile scalar, and a fuzz suite; parse is total."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from polca import yamlkit
from polca.errors import PolcaError
from polca.yamlkit import YamlError, YamlLimits
from tests.cpu import cpu_budget_s
from tests.fuzzing import FUZZ, mutated

# Seven levels of nine: 9**6 copies of nine "lol"s once expanded; 322 bytes with the header.
ALIAS_BOMB = (
    "# billion laughs ....................\n"
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(
        f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True)
    )
    + "h: [*g, *g]\n"
)
CONFIG_LIKE = """\
mqtt:
  host: broker.dc1
  port: 8883
  tls: true
defaults: &defaults {non_gpu_w: 500.0, non_gpu_factor: 0.1}
rows:
  - name: row1
    budget_w: 120000
    racks:
      - {name: r1, nodes: [{name: n1, <<: *defaults}, {name: n2, <<: *defaults}]}
when: 2023-11-16
ratio: 1:30
"""


def parse(text: str, **limits: int) -> Any:
    """The data of ``text`` parsed with the given limits (defaults otherwise)."""
    return yamlkit.parse(text, source="t.yaml", limits=YamlLimits(**limits)).data


def problem(text: str, **limits: int) -> YamlError:
    """The error ``text`` raises."""
    with pytest.raises(YamlError) as info:
        parse(text, **limits)
    return info.value


def test_valid_text_parses_like_safe_load() -> None:
    """Aliases, merge keys, dates and sexagesimal ints come out as PyYAML builds them."""
    assert parse(CONFIG_LIKE) == yaml.safe_load(CONFIG_LIKE)
    assert yamlkit.parse("", source="t").node is None
    assert parse("# only a comment\n") is None


def test_alias_bomb_is_refused_fast_at_its_anchor() -> None:
    """The 322-byte billion-laughs text is refused within milliseconds, at the node."""
    assert len(ALIAS_BOMB.encode()) == 322
    start = time.process_time()  # this process's CPU, whatever else the machine runs
    error = problem(ALIAS_BOMB)
    assert time.process_time() - start < cpu_budget_s(0.5)
    assert "expands" in str(error)
    # f's sequence: 9**5 x 9 "lol"s, 4 units each (a node and 3 characters), is over 2M.
    assert (error.line, error.column) == (7, 4)
    assert str(error).startswith("t.yaml:7:4: YAML expands")


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        "{a: " * 100_000,
        "- " * 100_000,
        "".join(" " * i + "k:\n" for i in range(2000)),
        "name: " + "[" * 2000 + "]" * 2000 + "\n",
    ],
    ids=["flow-seq", "flow-map", "block-seq", "block-map", "4kB-policy-like"],
)
def test_deep_nesting_is_refused_without_recursion(text: str) -> None:
    """100k open brackets are a YamlError at depth 65, never a RecursionError."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)  # far below what PyYAML would need without the bound
    try:
        error = problem(text[: YamlLimits().max_bytes])
    finally:
        sys.setrecursionlimit(limit)
    assert "nested deeper than 64" in str(error)
    assert error.line is not None


def test_nesting_through_aliases_counts() -> None:
    """Aliases cannot stack shallow anchors into a deep tree."""
    text = "a: &a [[[1]]]\nb: &b [[[*a]]]\nc: [[[*b]]]\n"
    assert parse(text, max_depth=11)["c"] == [[[[[[[[[1]]]]]]]]]
    assert "through aliases" in str(problem(text, max_depth=10))


@pytest.mark.parametrize(
    ("text", "limits", "fragment"),
    [
        ("a: " + "x" * 200, {"max_bytes": 100}, "larger than 100 bytes"),
        ("a: é" * 30, {"max_bytes": 100}, "larger than 100 bytes"),  # counted in UTF-8 bytes
        ("a: &a 1\nb: [" + "*a, " * 11 + "]", {"max_aliases": 10}, "more than 10 aliases"),
        ("a: " + "x" * 101, {"max_scalar_chars": 100}, "scalar of 101 characters"),
        ("? " + "k" * 101 + "\n: 1", {"max_scalar_chars": 100}, "scalar of 101 characters"),
        ("a: " + "9" * 41, {}, "integer of 41 characters"),
        ("a: !!int " + "1" * 5000, {}, "integer of 5000 characters"),
        ("a: &a [1, 2, 3]\nb: [*a, *a, *a]", {"max_expanded": 10}, "expands"),
    ],
)
def test_each_bound_is_enforced(text: str, limits: dict[str, int], fragment: str) -> None:
    """Size, aliases, scalar length, integer digits and expansion each have a bound."""
    assert fragment in str(problem(text, **limits))


@pytest.mark.parametrize(
    ("text", "fragment", "where"),
    [
        ("a: &a [*a]", "recursive data", (1, 4)),
        ("a: &a {<<: *a}", "recursive data", (1, 4)),
        ("a: 1\nb: 2\na: 3\n", "duplicate key 'a'", (3, 1)),
        ("a: 2023-02-30", "as timestamp: day is out of range", (1, 4)),
        ("a: !!timestamp 2023-11-16T25:00:00", "hour must be in 0..23", (1, 4)),
        ("a: !!int ''", "cannot read '' as int", (1, 4)),
        ("a: !!int 0x", "as int", (1, 4)),
        ("a: !!float x", "as float", (1, 4)),
        ("a: !!float ''", "as float", (1, 4)),
        ("a: .inf", "not finite", (1, 4)),
        ("a: -.INF", "not finite", (1, 4)),
        ("a: .nan", "not finite", (1, 4)),
        ("a: 1.0e+999", "not finite", (1, 4)),
        ("{[1]: 2}", "unhashable key", (1, 2)),
        ("? [a]\n: 1", "unhashable key", (1, 3)),
        ("!!set {[1]: null}", "unhashable key", (1, 8)),
        ("<<: [1]", "for merging", (1, 6)),
        ("a: !!python/object:os.system x", "could not determine a constructor", (1, 4)),
        ("a: b\nc: d\x00", "unacceptable character", (2, 5)),
        ("a: 1\n---\nb: 2\n", "single document", (2, 1)),
        ("a: [1, 2", "YAML syntax", (1, 9)),
        ("a: *nowhere", "undefined alias", (1, 4)),
        ('a: "\\ud800"', "lone surrogate", (1, 4)),
        ("a: &x 1\nb: &x 2", "duplicate anchor", (2, 4)),
    ],
)
def test_hostile_scalars_and_shapes_say_where(
    text: str, fragment: str, where: tuple[int, int]
) -> None:
    """Whatever PyYAML would raise (ValueError, IndexError, TypeError ...) is a YamlError."""
    error = problem(text)
    assert fragment in str(error)
    assert (error.line, error.column) == where
    assert str(error).startswith(f"t.yaml:{where[0]}:{where[1]}: ")
    assert isinstance(error, PolcaError)


def test_every_duplicate_key_is_listed_in_order() -> None:
    """Duplicates are all reported, sorted, each as SOURCE:LINE:COL: message."""
    error = problem("a: 1\nb: {x: 1, x: 2}\na: 2\n")
    assert error.lines() == ("t.yaml:2:11: duplicate key 'x'", "t.yaml:3:1: duplicate key 'a'")
    assert str(error) == "t.yaml:2:11: duplicate key 'x' (and 1 more)"


def test_merge_keys_may_override_without_being_duplicates() -> None:
    """``<<: *base`` then a key of base is an override, not a duplicate."""
    assert parse("base: &b {x: 1, y: 2}\nm: {<<: *b, x: 3}\n")["m"] == {"x": 3, "y": 2}


def test_read_bounded_stops_at_the_limit(tmp_path: Path) -> None:
    """A file over the limit is refused after reading one byte more than the limit."""
    path = tmp_path / "big.yaml"
    path.write_bytes(b"a: " + b"x" * 200)
    assert yamlkit.read_bounded(path, YamlLimits(max_bytes=500)) == path.read_bytes()
    with pytest.raises(YamlError, match=r"big\.yaml: YAML larger than 100 bytes"):
        yamlkit.read_bounded(path, YamlLimits(max_bytes=100))
    with pytest.raises(FileNotFoundError):
        yamlkit.read_bounded(tmp_path / "missing.yaml")


def check_total(text: str) -> None:
    """``parse`` returns what safe_load returns, or raises YamlError and nothing else."""
    try:
        data = yamlkit.parse(text, source="fuzz").data
    except YamlError as exc:
        error = exc
    else:
        assert data == yaml.safe_load(text)
        return
    assert error.problems
    assert str(error).startswith("fuzz")


@FUZZ
@given(text=mutated(CONFIG_LIKE) | mutated(ALIAS_BOMB))
def test_fuzz_mutated_yaml_only_raises_yaml_error(text: str) -> None:
    """Mutations of valid and bomb texts give the safe_load data or a YamlError."""
    check_total(text)


@FUZZ
@given(text=st.text(alphabet=st.sampled_from("[]{}:,-?&*!<>|'\"#%@` \n\tab01.~"), max_size=200))
def test_fuzz_yaml_syntax_soup_only_raises_yaml_error(text: str) -> None:
    """Random strings of YAML's indicator characters never escape as another error."""
    check_total(text)


# PyYAML itself does not round-trip the Unicode line separators in plain keys.
_chars = st.characters(
    codec="utf-8", exclude_categories=["Cs"], exclude_characters="\x85\u2028\u2029"
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(_chars, max_size=20)
)
_documents = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(_chars, max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@FUZZ
@given(data=_documents, flow=st.booleans())
def test_fuzz_dumped_data_round_trips(data: object, flow: bool) -> None:
    """Any data PyYAML dumps (within the bounds) parses back to equal data."""
    text = yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True)
    assert yamlkit.parse(text, source="fuzz").data == data
