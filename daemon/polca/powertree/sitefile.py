"""A site file read from disk: bounded YAML, the tree checked, problems at FILE:LINE:COL.

``load_site`` is what ``polca site check`` (and the site controller to come) call; every
problem ``model.build_tree`` finds is pointed at the line of the value it is about.
``describe`` draws the tree for an operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from polca import yamlkit
from polca.errors import ConfigError
from polca.powertree.model import Problem, SiteTree, build_tree

if TYPE_CHECKING:
    import yaml

__all__ = ["SiteFileError", "describe", "load_site", "parse_site"]

SITE_LIMITS = yamlkit.YamlLimits(max_bytes=4 * 1024 * 1024)
"""A site of thousands of domains, rows and feeds fits in a few hundred kB."""


class SiteFileError(ConfigError):
    """A site file polca refuses; ``problems`` has one ``FILE:LINE:COL: message`` each."""

    def __init__(self, msg: str, *, problems: tuple[str, ...]) -> None:
        """``msg`` says which file and how many problems."""
        super().__init__(msg)
        self.problems = problems


def load_site(path: Path) -> SiteTree:
    """The tree of the site file at ``path``; ``SiteFileError`` with every problem."""
    source = str(path)
    try:
        text = yamlkit.read_bounded(path, SITE_LIMITS).decode("utf-8")
    except OSError as exc:
        msg = f"cannot read the site file {source}: {exc.strerror or exc}"
        raise SiteFileError(msg, problems=(f"{source}:1:1: {msg}",)) from exc
    except UnicodeDecodeError as exc:
        msg = f"{source}: not UTF-8 ({exc.reason} at byte {exc.start})"
        raise SiteFileError(msg, problems=(f"{source}:1:1: {msg}",)) from exc
    except yamlkit.YamlError as exc:
        msg = f"{source}: {exc}"
        raise SiteFileError(msg, problems=exc.lines()) from exc
    return parse_site(text, source=source)


def parse_site(text: str, *, source: str) -> SiteTree:
    """The tree of a site file's ``text``; ``source`` names it in the problems."""
    try:
        document = yamlkit.parse(text, source=source, limits=SITE_LIMITS)
    except yamlkit.YamlError as exc:
        msg = f"{source}: {exc}"
        raise SiteFileError(msg, problems=exc.lines()) from exc
    tree, problems = build_tree(document.data)
    if tree is not None:
        return tree
    placed = sorted((_place(document.node, p), i, p) for i, p in enumerate(problems))
    lines = tuple(_line(source, place, p) for place, _, p in placed)
    noun = "problem" if len(lines) == 1 else "problems"
    msg = f"{source}: invalid site file ({len(lines)} {noun})"
    raise SiteFileError(msg, problems=lines)


def _place(root: yaml.Node | None, problem: Problem) -> tuple[int, int]:
    """The 1-based line and column of the value (or key) a problem is about."""
    if root is None:
        return 1, 1
    mark = yamlkit.node_at(root, problem.loc, key=problem.key).start_mark
    return mark.line + 1, mark.column + 1


def _line(source: str, place: tuple[int, int], problem: Problem) -> str:
    where = problem.where()
    prefix = f"{where}: " if where else ""
    return f"{source}:{place[0]}:{place[1]}: {prefix}{problem.message}"


def describe(tree: SiteTree) -> list[str]:
    """The tree, one line per domain, feed and row, indented by depth."""
    lines: list[str] = []

    def walk(name: str, depth: int) -> None:
        pad = "  " * depth
        if name in tree.rows:
            lines.append(f"{pad}row {name}: {_w(tree.rows[name].rating_w)}")
            return
        domain = tree.domains[name]
        flags = " (oversubscribed)" if domain.oversubscribed else ""
        battery = f", {_w(domain.battery_w)} on battery" if domain.battery_w else ""
        lines.append(f"{pad}{name} [{domain.kind}]: {_w(domain.rating_w)}{battery}{flags}")
        for feed in domain.feeds:
            sources = ", ".join(feed.sources) or "no meter"
            dark = "dark means down" if feed.loss_means_down and feed.sources else "state only"
            lines.append(f"{pad}  feed {feed.name}: {_w(feed.rating_w)} ({sources}; {dark})")
        for child in domain.supplies:
            walk(child, depth + 1)

    for root in tree.roots:
        walk(root, 0)
    return lines


def _w(watts: float) -> str:
    return f"{watts:,.0f} W"
