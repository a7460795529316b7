"""A site's power tree, read from plain data and checked whole (pure).

A site file describes the power domains above the rows (utility, generator, transformer,
switchboard, UPS, floor PDU, busway: any depth) and the rows at the bottom:

```yaml
rows:
  row1: {rating_w: 400000}
domains:
  ups-a:
    kind: ups
    rating_w: 1000000
    battery_w: 800000            # what it carries on battery (optional)
    feeds:                       # what it is fed by; none: its rating is its capacity
      - {name: A, rating_w: 600000, sources: [pdu-a1], loss_means_down: true}
      - {name: B, rating_w: 600000, sources: [row1/pdu-b1]}
    supplies: [row1, row2]       # rows or domains
```

A feed's source is a ``polca meter`` source: ``GROUP/SOURCE`` (the meter group, the topic
segment its readings come on, and the source's name there) or ``SOURCE`` alone (that name
in any group).

``build_tree`` turns the data into a ``SiteTree`` and lists every problem at once, each
with the path of the value it is about (``domains.ups-a.feeds[1].rating_w``), so a loader
can point at the file's line: an unknown key, a missing or non-positive rating, a name
that is not a topic segment, a cycle, something supplied by two domains or by nothing, a
domain that supplies nothing, a child rated above its parent without
``oversubscribed: true``, a feed rated above its domain's rating (allowed: a 2N pair's
feeds each carry the whole domain, so that is checked against the domain, not the sum).

What it must not do: read files, read a clock, or know the meter's or the aggregator's
types.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeGuard, get_args

from polca.settings import TOPIC_SEGMENT
from polca.telemetry.topics import RESERVED_DOMAIN_NAMES, RESERVED_ROW_NAMES

__all__ = [
    "MAX_NAMES",
    "Domain",
    "DomainKind",
    "Feed",
    "Problem",
    "RowLeaf",
    "SiteTree",
    "build_tree",
]

DomainKind = Literal[
    "utility", "generator", "transformer", "switchboard", "ups", "floor_pdu", "busway", "other"
]
MAX_NAMES = 4096
"""Domains, rows or feeds one site file may hold, each (a bound on a hand-written file)."""
MAX_RATING_W = 1e10
"""10 GW: above any site; a larger rating is a typing error."""
_NAME = re.compile(TOPIC_SEGMENT)  # rows and domains name topics
RESERVED_NAMES: Mapping[str, frozenset[str]] = {
    "rows": RESERVED_ROW_NAMES,
    "domains": RESERVED_DOMAIN_NAMES,
}
"""Names a row or a domain may not have (polca's own topic levels)."""
_DOMAIN_KEYS = frozenset({"kind", "rating_w", "battery_w", "feeds", "supplies", "oversubscribed"})
_FEED_KEYS = frozenset({"name", "rating_w", "sources", "loss_means_down"})
_ROW_KEYS = frozenset({"rating_w"})
_KINDS: dict[object, DomainKind] = {kind: kind for kind in get_args(DomainKind)}

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the tree: where (a path into the data) and what."""

    loc: Loc
    message: str
    key: bool = False
    """About the last key of ``loc`` itself (an unknown key), not its value."""

    def where(self) -> str:
        """The path as text: ``domains.ups-a.feeds[1].rating_w``."""
        out = ""
        for part in self.loc:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
        return out


@dataclass(frozen=True, slots=True)
class Feed:
    """One input of a domain: its rating and the meter sources that measure it."""

    name: str
    rating_w: float
    sources: tuple[str, ...] = ()
    loss_means_down: bool = True
    """A meter that goes dark means the feed is down (it is powered by what it measures)."""


@dataclass(frozen=True, slots=True)
class Domain:
    """A piece of the power path above rows: its rating, its feeds, what it supplies."""

    name: str
    kind: DomainKind
    rating_w: float
    supplies: tuple[str, ...]
    feeds: tuple[Feed, ...] = ()
    battery_w: float | None = None
    oversubscribed: bool = False


@dataclass(frozen=True, slots=True)
class RowLeaf:
    """A row at the bottom of the tree and its own rating."""

    name: str
    rating_w: float


@dataclass(frozen=True, slots=True)
class SiteTree:
    """A checked tree: every row and domain has at most one parent, there is no cycle."""

    domains: Mapping[str, Domain]
    rows: Mapping[str, RowLeaf]
    parent: Mapping[str, str]
    """Each supplied row or domain's parent domain."""

    @property
    def roots(self) -> tuple[str, ...]:
        """The domains nothing supplies, in file order."""
        return tuple(name for name in self.domains if name not in self.parent)

    def chain(self, name: str) -> tuple[str, ...]:
        """The domains above ``name``, nearest first."""
        out: list[str] = []
        at = self.parent.get(name)
        while at is not None:
            out.append(at)
            at = self.parent.get(at)
        return tuple(out)

    def rating_w(self, name: str) -> float:
        """A row's or a domain's own rating."""
        leaf = self.rows.get(name)
        return leaf.rating_w if leaf is not None else self.domains[name].rating_w


def build_tree(data: object) -> tuple[SiteTree | None, list[Problem]]:
    """The tree of ``data`` (a site file's mapping with ``rows`` and ``domains``), or None
    and every problem found; a tree is only returned when there are none."""
    problems: list[Problem] = []
    if not isinstance(data, Mapping):
        return None, [Problem((), "a site file is a mapping with rows and domains")]
    rows = _rows(data.get("rows"), problems)
    domains = _domains(data.get("domains"), problems)
    for name in rows.keys() & domains.keys():
        problems.append(Problem(("domains", name), f"{name!r} is both a row and a domain"))
    parent = _links(domains, rows, problems)
    if not problems:
        _cycles(domains, parent, problems)
    if not problems:
        _ratings(domains, rows, problems)
    if problems:
        return None, problems
    return SiteTree(domains=domains, rows=rows, parent=parent), []


def _rows(raw: object, problems: list[Problem]) -> dict[str, RowLeaf]:
    out: dict[str, RowLeaf] = {}
    for name, value in _named(raw, ("rows",), problems):
        if _keys(value, _ROW_KEYS, ("rows", name), problems):
            rating = _rating(value.get("rating_w"), ("rows", name, "rating_w"), problems)
            out[name] = RowLeaf(name, rating)
    if not out and not any(p.loc[:1] == ("rows",) for p in problems):
        problems.append(Problem(("rows",), "a site has at least one row"))
    return out


def _domains(raw: object, problems: list[Problem]) -> dict[str, Domain]:
    out: dict[str, Domain] = {}
    for name, value in _named(raw, ("domains",), problems):
        loc: Loc = ("domains", name)
        if not _keys(value, _DOMAIN_KEYS, loc, problems):
            continue
        kind = _KINDS.get(value.get("kind", "other"))
        if kind is None:
            problems.append(
                Problem((*loc, "kind"), f"kind must be one of {sorted(_KINDS.values())}")
            )
            kind = "other"
        rating = _rating(value.get("rating_w"), (*loc, "rating_w"), problems)
        battery = value.get("battery_w")
        battery_w = None if battery is None else _rating(battery, (*loc, "battery_w"), problems)
        over = value.get("oversubscribed", False)
        if not isinstance(over, bool):
            problems.append(Problem((*loc, "oversubscribed"), "must be true or false"))
            over = False
        supplies = _names(value.get("supplies"), (*loc, "supplies"), problems)
        if not supplies:
            problems.append(Problem((*loc, "supplies"), "a domain supplies at least one row"))
        feeds = _feeds(value.get("feeds", ()), (*loc, "feeds"), rating, problems)
        out[name] = Domain(name, kind, rating, supplies, feeds, battery_w, over)
    return out


def _feeds(raw: object, loc: Loc, domain_w: float, problems: list[Problem]) -> tuple[Feed, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        problems.append(Problem(loc, "feeds is a list"))
        return ()
    out: list[Feed] = []
    seen: set[str] = set()
    for i, value in enumerate(raw[: MAX_NAMES + 1]):
        at: Loc = (*loc, i)
        if i == MAX_NAMES:
            problems.append(Problem(at, f"more than {MAX_NAMES} feeds"))
            break
        if not _keys(value, _FEED_KEYS, at, problems):
            continue
        name = value.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(Problem((*at, "name"), "a feed's name is 1-128 of A-Za-z0-9_.-"))
            continue
        if name in seen:
            problems.append(Problem((*at, "name"), f"feed {name!r} is listed twice"))
            continue
        seen.add(name)
        rating = _rating(value.get("rating_w"), (*at, "rating_w"), problems)
        if rating > domain_w > 0:
            problems.append(
                Problem((*at, "rating_w"), f"a feed rated above its domain's {domain_w:g} W")
            )
        sources = _names(value.get("sources", ()), (*at, "sources"), problems, grouped=True)
        down = value.get("loss_means_down", True)
        if not isinstance(down, bool):
            problems.append(Problem((*at, "loss_means_down"), "must be true or false"))
            down = True
        out.append(Feed(name, rating, sources, down))
    return tuple(out)


def _links(
    domains: Mapping[str, Domain], rows: Mapping[str, RowLeaf], problems: list[Problem]
) -> dict[str, str]:
    parent: dict[str, str] = {}
    for domain in domains.values():
        for i, child in enumerate(domain.supplies):
            loc: Loc = ("domains", domain.name, "supplies", i)
            if child not in domains and child not in rows:
                problems.append(Problem(loc, f"{child!r} is neither a row nor a domain"))
            elif child == domain.name:
                problems.append(Problem(loc, f"{child!r} supplies itself"))
            elif child in parent:
                problems.append(Problem(loc, f"{child!r} is already supplied by {parent[child]!r}"))
            else:
                parent[child] = domain.name
    for row in rows:
        if row not in parent:
            problems.append(Problem(("rows", row), f"row {row!r} is supplied by no domain"))
    return parent


def _cycles(
    domains: Mapping[str, Domain], parent: Mapping[str, str], problems: list[Problem]
) -> None:
    for name in domains:
        seen = {name}
        at = parent.get(name)
        while at is not None:
            if at in seen:
                problems.append(Problem(("domains", name), f"{name!r} is in a cycle"))
                break
            seen.add(at)
            at = parent.get(at)


def _ratings(
    domains: Mapping[str, Domain], rows: Mapping[str, RowLeaf], problems: list[Problem]
) -> None:
    for domain in domains.values():
        if domain.oversubscribed:
            continue
        for i, child in enumerate(domain.supplies):
            child_w = rows[child].rating_w if child in rows else domains[child].rating_w
            if child_w > domain.rating_w:
                problems.append(
                    Problem(
                        ("domains", domain.name, "supplies", i),
                        f"{child!r} is rated {child_w:g} W, above {domain.name!r}'s "
                        f"{domain.rating_w:g} W (say oversubscribed: true if meant)",
                    )
                )


def _named(raw: object, loc: Loc, problems: list[Problem]) -> list[tuple[str, object]]:
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        problems.append(Problem(loc, f"{loc[-1]} is a mapping of names"))
        return []
    if len(raw) > MAX_NAMES:
        problems.append(Problem(loc, f"more than {MAX_NAMES} entries"))
        return []
    out: list[tuple[str, object]] = []
    reserved = RESERVED_NAMES[str(loc[-1])] if loc[-1] in RESERVED_NAMES else frozenset()
    for name, value in raw.items():
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(Problem((*loc, str(name)), "a name is 1-128 of A-Za-z0-9_.-"))
            continue
        if name in reserved:
            problems.append(
                Problem((*loc, name), f"{name!r} is reserved (a polca topic level)", key=True)
            )
            continue
        out.append((name, value))
    return out


def _keys(
    value: object, allowed: frozenset[str], loc: Loc, problems: list[Problem]
) -> TypeGuard[Mapping[str, object]]:
    if not isinstance(value, Mapping):
        problems.append(Problem(loc, "expected a mapping (key: value)"))
        return False
    for key in sorted(str(k) for k in value if k not in allowed):
        problems.append(Problem((*loc, key), f"unknown key {key!r}", key=True))
    return True  # a mapping: its known keys are checked too, so every problem shows at once


def _rating(value: object, loc: Loc, problems: list[Problem]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.append(Problem(loc, "a rating in W is a number"))
        return 0.0
    if not 0 < value <= MAX_RATING_W:
        problems.append(Problem(loc, f"a rating is above 0 W and at most {MAX_RATING_W:g} W"))
        return 0.0
    return float(value)


def _names(
    raw: object, loc: Loc, problems: list[Problem], *, grouped: bool = False
) -> tuple[str, ...]:
    """A list of names; ``grouped``: each may be ``GROUP/NAME`` (a meter source)."""
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        problems.append(Problem(loc, "expected a list of names"))
        return ()
    if len(raw) > MAX_NAMES:
        problems.append(Problem(loc, f"more than {MAX_NAMES} names"))
        return ()
    out: list[str] = []
    for i, name in enumerate(raw):
        parts = name.split("/") if isinstance(name, str) else [None]
        if len(parts) > (2 if grouped else 1) or not all(
            isinstance(p, str) and _NAME.match(p) for p in parts
        ):
            form = "NAME or GROUP/NAME" if grouped else "a name"
            problems.append(Problem((*loc, i), f"{form}: each name 1-128 of A-Za-z0-9_.-"))
        elif name in out:
            problems.append(Problem((*loc, i), f"{name!r} is listed twice"))
        else:
            out.append(name)
    return tuple(out)
