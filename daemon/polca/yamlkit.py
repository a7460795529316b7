"""Bounded YAML loading: the one place polca turns YAML text into Python data.

Why it exists: policy files, configuration files and register maps are YAML written by
hand or received over the network, and PyYAML trusts its input. A 4 kB file of nested
``[`` overflows the composer's recursion, a few hundred bytes of aliases (a "billion
laughs") expand into millions of nodes that every later walk pays for, and some scalars
(``2023-02-30``, ``!!int ""``, a 5,000-digit integer) raise plain ``ValueError`` or
``IndexError`` from the constructor. ``parse`` is total: it returns a ``Document`` or
raises ``YamlError``, which says where (``SOURCE:LINE:COL``) whenever the text does.

How, in order, each step bounded before the next one runs:

1. the text's size (``YamlLimits.max_bytes``), before the scanner sees it;
2. composition into a node tree with a nesting bound (``max_depth``, checked as each node
   opens, so the recursion of PyYAML's composer stays shallow whatever the text), an alias
   bound (``max_aliases``) and a scalar length bound (``max_scalar_chars``); a scalar
   holding a lone surrogate (which only an escape such as ``"\\ud800"`` can write) is refused;
3. one walk over the distinct nodes, memoised per node so that it is linear in the text
   and not in the expansion: the size of the data as if every alias were replaced by a
   copy of its anchor (nodes plus scalar characters, ``max_expanded``), its nesting depth
   through aliases (``max_depth`` again), recursive aliases (refused: nothing in polca is
   recursive data) and duplicate keys (refused: PyYAML silently keeps the last one, which
   would hide an edit);
4. construction of the Python data from that same node tree (parsed once), with integers
   bounded in digits (``max_int_digits``) before ``int()`` runs, floats finite, and any
   other constructor failure turned into a ``YamlError`` at the node.

What it must not do: know any schema (callers validate the data), read configuration, or
log. Only safe YAML tags are understood (``yaml.SafeLoader``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from polca.errors import YamlError, YamlProblem

__all__ = [
    "DEFAULT_LIMITS",
    "Document",
    "YamlError",
    "YamlLimits",
    "YamlProblem",
    "node_at",
    "parse",
    "read_bounded",
]

_MAX_PROBLEMS = 100  # duplicate keys reported at most; one is enough to refuse the text
_SHOWN_CHARS = 60  # of a scalar quoted in a message
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class YamlLimits:
    """Bounds on one YAML text; the defaults fit configuration files (policies use less)."""

    max_bytes: int = 1024 * 1024
    """Size of the text, UTF-8 encoded: checked before parsing."""
    max_depth: int = 64
    """Nesting of sequences and mappings, also through aliases."""
    max_aliases: int = 1024
    """Alias nodes (``*name``) in the text."""
    max_expanded: int = 2_000_000
    """Nodes plus scalar characters, counting every alias as a copy of its anchor."""
    max_scalar_chars: int = 64 * 1024
    """Characters of one scalar (a key or a value)."""
    max_int_digits: int = 40
    """Characters of an integer scalar (sign, prefix and ``_`` included)."""


DEFAULT_LIMITS = YamlLimits()


def _error(source: str, message: str, mark: yaml.Mark | None = None) -> YamlError:
    if mark is None:
        return YamlError(source, (YamlProblem(message),))
    return YamlError(source, (YamlProblem(message, mark.line + 1, mark.column + 1),))


@dataclass(frozen=True, slots=True)
class Document:
    """A parsed text: its node tree (positions for messages) and its Python data.

    ``node`` is None for an empty text, and ``data`` then None too. Aliased parts of
    ``data`` are shared objects, not copies; merge keys (``<<``) are applied to both.
    """

    node: yaml.Node | None
    data: Any


def read_bounded(path: Path, limits: YamlLimits = DEFAULT_LIMITS) -> bytes:
    """The bytes of ``path``, refusing a file over ``limits.max_bytes`` without reading it all.

    Raises ``OSError`` when the file cannot be read, ``YamlError`` when it is too large.
    """
    with path.open("rb") as f:
        data = f.read(limits.max_bytes + 1)
    if len(data) > limits.max_bytes:
        msg = f"YAML larger than {limits.max_bytes} bytes"
        raise _error(str(path), msg)
    return data


def load_file(
    path: Path,
    *,
    what: str,
    error: type[Exception],
    limits: YamlLimits = DEFAULT_LIMITS,
    source: str | None = None,
) -> Any:
    """The data of the YAML file at ``path`` (bounded, UTF-8, one document; None if empty).

    Every failure (unreadable, too large, not UTF-8, malformed) raises ``error`` with a
    message naming ``what`` ("configuration", "profile") and the file, chained.
    """
    source = source or str(path)
    try:
        text = read_bounded(path, limits).decode("utf-8")
        return parse(text, source=source, limits=limits).data
    except OSError as exc:
        msg = f"cannot read {what} {source}: {exc.strerror or exc}"
        raise error(msg) from exc
    except UnicodeDecodeError as exc:
        msg = f"cannot read {what} {source}: not UTF-8 ({exc.reason} at byte {exc.start})"
        raise error(msg) from exc
    except YamlError as exc:
        msg = f"cannot read {what} {exc}"
        raise error(msg) from exc


def parse(text: str, *, source: str, limits: YamlLimits = DEFAULT_LIMITS) -> Document:
    """Parse one YAML document within ``limits``; ``source`` names it in messages.

    Raises ``YamlError`` for malformed text, more than one document, a bound exceeded,
    recursive aliases, duplicate keys, or a scalar its tag cannot hold.
    """
    if (
        len(text) > limits.max_bytes
        or len(text.encode("utf-8", "surrogatepass")) > limits.max_bytes
    ):
        msg = f"YAML larger than {limits.max_bytes} bytes"
        raise _error(source, msg)
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text, source=source, limits=limits)  # checks the characters
        node = loader.get_single_node()
        if node is None:
            return Document(None, None)
        _check_tree(node, source, limits)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        raise _error(source, f"YAML syntax: {what}", mark) from exc
    except yaml.reader.ReaderError as exc:
        raise YamlError(source, (_reader_problem(text, exc),)) from exc
    except yaml.YAMLError as exc:
        raise _error(source, f"YAML: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
        # Raised by a constructor outside ``construct_object`` (a collection's second half).
        raise _error(source, f"YAML: cannot construct the data: {exc}") from exc
    finally:
        if loader is not None:
            loader.dispose()
    return Document(node, data)


def _reader_problem(text: str, exc: yaml.reader.ReaderError) -> YamlProblem:
    """A character PyYAML refuses (control characters, lone surrogates), with its place."""
    position = exc.position if isinstance(exc.position, int) else 0
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "?")
    return YamlProblem(f"YAML: unacceptable character #x{char:04x}", line, column)


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` whose composer and constructor enforce ``YamlLimits``."""

    def __init__(self, text: str, *, source: str, limits: YamlLimits) -> None:
        super().__init__(text)
        self._source = source
        self._limits = limits
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        """Compose one node, refusing it beyond the depth, alias or scalar bound."""
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > self._limits.max_aliases:
                msg = f"YAML with more than {self._limits.max_aliases} aliases"
                raise _error(self._source, msg, self._next_mark())
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > self._limits.max_depth:
                msg = f"YAML nested deeper than {self._limits.max_depth} levels"
                raise _error(self._source, msg, self._next_mark())
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.ScalarNode):
            self._check_scalar(node)
        return node

    def _check_scalar(self, node: yaml.ScalarNode) -> None:
        if len(node.value) > self._limits.max_scalar_chars:
            msg = (
                f"YAML scalar of {len(node.value)} characters; at most "
                f"{self._limits.max_scalar_chars} are accepted"
            )
            raise _error(self._source, msg, node.start_mark)
        if _SURROGATE.search(node.value):  # from a "\ud800" escape: not text, cannot be encoded
            msg = "YAML scalar with a lone surrogate escape (not a Unicode character)"
            raise _error(self._source, msg, node.start_mark)

    def _next_mark(self) -> yaml.Mark:
        mark: yaml.Mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        return mark

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """Construct one node; a value its tag cannot hold is a ``YamlError`` at the node."""
        try:
            return super().construct_object(node, deep)
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
            # PyYAML's scalar constructors call int(), float(), date() and index strings
            # without checking them first (``!!int ""`` is an IndexError).
            shown = _shown(node.value) if isinstance(node, yaml.ScalarNode) else "the value"
            msg = f"YAML: cannot read {shown} as {_tag_name(node.tag)}: {exc}"
            raise _error(self._source, msg, node.start_mark) from exc

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        """``!!int``, refusing more than ``max_int_digits`` characters before ``int()``."""
        if len(node.value) > self._limits.max_int_digits:
            msg = (
                f"YAML integer of {len(node.value)} characters; at most "
                f"{self._limits.max_int_digits} are accepted"
            )
            raise _error(self._source, msg, node.start_mark)
        value: int = self.construct_yaml_int(node)
        return value

    def construct_finite_float(self, node: yaml.ScalarNode) -> float:
        """``!!float``, refusing infinities and NaN (also overflow such as ``1.0e+999``)."""
        value: float = self.construct_yaml_float(node)
        if not math.isfinite(value):
            msg = f"YAML number {_shown(node.value)} is not finite"
            raise _error(self._source, msg, node.start_mark)
        return value


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_bounded_int)
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader.construct_finite_float)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _tag_name(tag: str) -> str:
    return tag.removeprefix("tag:yaml.org,2002:")


def _check_tree(root: yaml.Node, source: str, limits: YamlLimits) -> None:
    """Expanded size and depth, recursive aliases and duplicate keys, in one linear walk.

    Each distinct node is measured once (aliases make the tree a DAG), with an explicit
    stack: no recursion, whatever the text. A node met again while its own walk is open is
    an alias to an ancestor.
    """
    size: dict[int, int] = {}  # id(node) -> expanded size
    height: dict[int, int] = {}  # id(node) -> expanded nesting depth
    open_nodes: set[int] = set()
    duplicates: list[YamlProblem] = []
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            open_nodes.discard(key)
            total = 1 + sum(size[id(c)] for c in children)
            if isinstance(node, yaml.ScalarNode):
                total += len(node.value)
            depth = 1 + max((height[id(c)] for c in children), default=0)
            if total > limits.max_expanded:
                msg = (
                    f"YAML expands (aliases counted as copies) to more than "
                    f"{limits.max_expanded} nodes and characters"
                )
                raise _error(source, msg, node.start_mark)
            if depth > limits.max_depth:
                msg = f"YAML nested deeper than {limits.max_depth} levels (through aliases)"
                raise _error(source, msg, node.start_mark)
            size[key], height[key] = total, depth
            continue
        if key in size:
            continue  # an alias of a node measured already
        if key in open_nodes:
            msg = "YAML alias refers to a node that contains it (recursive data)"
            raise _error(source, msg, node.start_mark)
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode) and len(duplicates) < _MAX_PROBLEMS:
            duplicates.extend(_duplicate_keys(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)
    if duplicates:
        ordered = sorted(duplicates, key=lambda p: (p.line or 0, p.column or 0))
        raise YamlError(source, tuple(ordered[:_MAX_PROBLEMS]))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _duplicate_keys(node: yaml.MappingNode) -> list[YamlProblem]:
    seen: set[str] = set()
    found: list[YamlProblem] = []
    for key, _value in node.value:
        if isinstance(key, yaml.ScalarNode):
            if key.value in seen:
                mark = key.start_mark
                found.append(
                    YamlProblem(
                        f"duplicate key {_shown(key.value)}", mark.line + 1, mark.column + 1
                    )
                )
            seen.add(key.value)
    return found


def node_at(root: yaml.Node, loc: Sequence[str | int], *, key: bool = False) -> yaml.Node:
    """The deepest node of ``root`` along ``loc`` (mapping keys, sequence indices), for
    pointing a message at its line; ``key``: the key node of the last step, not its value.

    A path that leaves the tree ends at the last node it reached (a missing key: the
    mapping that lacks it).
    """
    node = root
    for i, part in enumerate(loc):
        want_key = key and i == len(loc) - 1
        if isinstance(node, yaml.MappingNode):
            for k, value in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    node = k if want_key else value
                    break
            else:
                return node
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                return node
            node = node.value[part]
        else:
            return node
    return node
