"""Site files on disk and ``polca site check``: the tree, or every problem at FILE:LINE:COL."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from polca.powertree.sitefile import SITE_LIMITS, SiteFileError, load_site, parse_site
from polca.sitectl.cli import run_check

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "site" / "site.example.yaml"

BAD: Final = """\
rows:
  row1: {rating_w: 400000}
  row2: {rating_w: 400000}
domains:
  ups-a:
    kind: ups
    rating_w: 300000
    colour: red
    feeds:
      - {name: A, rating_w: 500000}
    supplies: [row1, row3]
"""


def test_the_shipped_example_is_a_sound_tree() -> None:
    tree = load_site(EXAMPLE)
    assert tree.roots == ("utility",)
    assert tree.chain("row1") == ("ups-a", "switchboard-1", "utility")
    assert [f.name for f in tree.domains["ups-a"].feeds] == ["A", "B"]


def test_every_problem_points_at_its_line_in_file_order() -> None:
    with pytest.raises(SiteFileError) as caught:
        parse_site(BAD, source="site.yaml")
    assert caught.value.problems == (
        "site.yaml:3:9: rows.row2: row 'row2' is supplied by no domain",
        "site.yaml:8:5: domains.ups-a.colour: unknown key 'colour'",
        "site.yaml:10:29: domains.ups-a.feeds[0].rating_w: a feed rated above its domain's "
        "300000 W",
        "site.yaml:11:22: domains.ups-a.supplies[1]: 'row3' is neither a row nor a domain",
    )
    assert str(caught.value) == "site.yaml: invalid site file (4 problems)"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("rows: [\n", "site.yaml:2:1:"),  # malformed YAML
        ("rows:\n  a: 1\n  a: 2\n", "site.yaml:3:3:"),  # a duplicate key hides an edit
        ("", "site.yaml:1:1:"),  # empty
    ],
)
def test_bad_yaml_is_a_problem_with_its_place(text: str, line: str) -> None:
    with pytest.raises(SiteFileError) as caught:
        parse_site(text, source="site.yaml")
    assert caught.value.problems[0].startswith(line), caught.value.problems


def test_an_oversized_or_unreadable_file_is_refused_without_reading_it_all(
    tmp_path: Path,
) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (SITE_LIMITS.max_bytes + 1))
    with pytest.raises(SiteFileError, match="larger than"):
        load_site(big)
    with pytest.raises(SiteFileError, match="cannot read the site file"):
        load_site(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"rows: \xff\n")
    with pytest.raises(SiteFileError, match="not UTF-8"):
        load_site(binary)


def test_check_prints_the_tree_or_the_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD, encoding="utf-8")
    out: list[str] = []
    err: list[str] = []

    class _Sink:
        def __init__(self, into: list[str]) -> None:
            self.into = into

        def write(self, text: str) -> int:
            self.into.append(text)
            return len(text)

    assert run_check([EXAMPLE], out=_Sink(out), err=_Sink(err)) == 0  # type: ignore[arg-type]
    assert "ok (3 domains, 2 feeds, 2 rows)" in out[0]
    assert any(
        "feed B: 500,000 W (row1/pdu-b, row2/pdu-b; dark means down)" in line for line in out
    )
    assert err == []
    assert run_check([EXAMPLE, bad], out=_Sink(out), err=_Sink(err)) == 1  # type: ignore[arg-type]
    assert len(err) == 4
