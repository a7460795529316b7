"""Read policy YAML into a ``Policy``, reporting every problem as ``FILE:LINE:COL: message``.

Operators edit policies by hand, so an error must say where it is, like a compiler does.
The text is parsed once by ``polca.yamlkit`` (bounded in size, nesting, aliases and their
expansion; duplicate keys refused) into a YAML node tree, which keeps each node's
position, and the plain data built from it; pydantic validates the data, and each error
location is mapped back onto the node it names: the key itself for an unknown key, the
enclosing mapping for a missing key, the value otherwise. Lines and columns are 1-based.
At most ``MAX_PROBLEMS`` problems are reported per text.

``PolicyStore`` keeps the last good policy when a reload fails (a typo must never uncap or
overcap a fleet); it logs each outcome once, so callers need not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from polca import yamlkit
from polca.errors import PolicyError
from polca.policy.model import KEY, RULE_ERROR_TYPE, Loc, Policy, format_loc

_log = structlog.get_logger()

REVISION_HEX_DIGITS = 12
MAX_PROBLEMS = 100  # reported per text; the last line says how many more there were
MAX_POLICY_BYTES = 64 * 1024
"""A policy is a few kB. Pure-Python YAML parses about 100 kB/s of hostile text, and the
agent parses a pushed policy on its event loop, so this caps one hostile parse near 0.7 s.
The wire's ``PolicyBundle.text`` has the same bound."""
POLICY_LIMITS = yamlkit.YamlLimits(max_bytes=MAX_POLICY_BYTES)


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    """A validated policy and where it came from."""

    policy: Policy
    source: str  # the file path, or a label such as "mqtt:polca/v1/site/policy"
    revision: str  # first 12 hex digits of the SHA-256 of the text's bytes
    text: str
    path: Path | None = None  # set when read from a file


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """Outcome of ``PolicyStore.reload``: what is in force now and what went wrong."""

    changed: bool  # a new revision is in force
    loaded: LoadedPolicy | None  # the policy in force after the call (the last good one)
    errors: tuple[str, ...] = ()  # FILE:LINE:COL problems; empty on success

    @property
    def ok(self) -> bool:
        """True when the file was valid."""
        return not self.errors


def revision_of(data: bytes) -> str:
    """The revision of a policy text: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(data).hexdigest()[:REVISION_HEX_DIGITS]


def load_policy(path: Path) -> LoadedPolicy:
    """Read and validate the policy file at ``path``.

    Raises:
        PolicyError: the file is unreadable or invalid; ``problems`` has one line each.
    """
    try:
        data = yamlkit.read_bounded(path, POLICY_LIMITS)
    except OSError as exc:
        msg = f"cannot read policy file {path}: {exc.strerror or exc}"
        raise PolicyError(msg, problems=(f"{path}:1:1: {msg}",)) from exc
    except yamlkit.YamlError as exc:
        msg = f"cannot read policy file {exc}"
        raise PolicyError(msg, problems=exc.lines()) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"policy file {path} is not UTF-8: {exc.reason} at byte {exc.start}"
        raise PolicyError(msg, problems=(f"{path}:1:1: {msg}",)) from exc
    loaded = _parse(text, source=str(path), revision=revision_of(data))
    return LoadedPolicy(
        policy=loaded.policy,
        source=loaded.source,
        revision=loaded.revision,
        text=text,
        path=path,
    )


def parse_policy(text: str, *, source: str) -> LoadedPolicy:
    """Validate policy YAML received as text (e.g. over MQTT); ``source`` names it in errors.

    Raises:
        PolicyError: the text is invalid; ``problems`` has one ``SOURCE:LINE:COL`` line each.
    """
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a JSON "\\ud800" escape
        msg = f"{source}: the policy is not valid Unicode: {exc.reason} at {exc.start}"
        raise PolicyError(msg, problems=(f"{source}:1:1: {msg}",)) from exc
    return _parse(text, source=source, revision=revision_of(data))


def check_files(paths: Iterable[Path]) -> list[str]:
    """Every problem in the given policy files, in order; an empty list means all are valid."""
    problems: list[str] = []
    for path in paths:
        try:
            load_policy(path)
        except PolicyError as exc:
            problems.extend(exc.problems)
    return problems


def _parse(text: str, *, source: str, revision: str) -> LoadedPolicy:
    try:
        document = yamlkit.parse(text, source=source, limits=POLICY_LIMITS)
    except yamlkit.YamlError as exc:
        msg = f"{source}: invalid YAML: {exc}"
        raise PolicyError(msg, problems=exc.lines()) from exc
    root = document.node
    if root is None:
        msg = f"{source}: the policy is empty"
        raise PolicyError(msg, problems=(f"{source}:1:1: the policy is empty",))
    try:
        policy = Policy.model_validate(document.data)
    except ValidationError as exc:
        problems = tuple(_problems(exc, root, source))
        noun = "problem" if len(problems) == 1 else "problems"
        msg = f"{source}: invalid policy ({len(problems)} {noun})"
        raise PolicyError(msg, problems=problems) from exc
    return LoadedPolicy(policy=policy, source=source, revision=revision, text=text)


def _problems(exc: ValidationError, root: yaml.Node, source: str) -> list[str]:
    # Sorted by position like a compiler's output; the sort is stable for equal positions.
    found: dict[str, tuple[int, int]] = {}
    for err in exc.errors(include_url=False):
        if err["type"] == RULE_ERROR_TYPE:
            ctx: Mapping[str, Any] = err.get("ctx") or {}
            for sub_loc, msg in ctx.get("problems", ()):
                node, line = _line(source, root, (*err["loc"], *sub_loc), msg, kind="rule")
                found.setdefault(line, (node.start_mark.line, node.start_mark.column))
        else:
            node, line = _line(source, root, err["loc"], _message(err), kind=err["type"])
            found.setdefault(line, (node.start_mark.line, node.start_mark.column))
    ordered = sorted(found, key=found.__getitem__)
    if len(ordered) > MAX_PROBLEMS:
        more = len(ordered) - MAX_PROBLEMS
        ordered = [*ordered[:MAX_PROBLEMS], f"{source}:1:1: ... and {more} more problems"]
    return ordered


def _message(err: ErrorDetails) -> str:
    loc = err["loc"]
    if err["type"] == "extra_forbidden" and loc:
        return f"unknown key {loc[-1]!r}"
    if err["type"] == "missing" and loc:
        return f"missing required key {loc[-1]!r}"
    if err["type"] == "model_type":
        return "expected a mapping (key: value)"
    if err["type"] == "tuple_type":
        return "Input should be a list"
    return str(err["msg"])


def _line(source: str, root: yaml.Node, loc: Loc, msg: str, *, kind: str) -> tuple[yaml.Node, str]:
    if kind == "missing":
        node = _find(root, loc[:-1])  # the mapping that lacks the key
    elif kind == "extra_forbidden":
        node = _find(root, (*loc, KEY))  # the unknown key itself
    else:
        node = _find(root, loc)
    where = format_loc(loc[:-1] if kind in {"missing", "extra_forbidden"} else loc)
    prefix = f"{where}: " if where else ""
    return node, f"{_at(source, node)}: {prefix}{msg}"


def _at(source: str, node: yaml.Node) -> str:
    return f"{source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def _find(root: yaml.Node, loc: Sequence[str | int]) -> yaml.Node:
    """The deepest node along ``loc``; a trailing ``KEY`` selects the key node of a mapping."""
    if loc and loc[-1] == KEY:
        return yamlkit.node_at(root, [p for p in loc[:-1] if p != KEY], key=True)
    return yamlkit.node_at(root, [p for p in loc if p != KEY])


class PolicyStore:
    """The policy file in force: reload on demand, keep the last good one on failure.

    Construction does no I/O; call ``reload()`` to read the file the first time.
    """

    def __init__(self, path: Path) -> None:
        """Watch ``path``; nothing is read until ``reload()``."""
        self._path = path
        self._current: LoadedPolicy | None = None

    @property
    def path(self) -> Path:
        """The policy file."""
        return self._path

    @property
    def current(self) -> LoadedPolicy | None:
        """The last good policy, or None when no valid file was ever read."""
        return self._current

    @property
    def in_force(self) -> LoadedPolicy:
        """The last good policy; ``PolicyError`` when no valid file was ever read."""
        if self._current is None:
            msg = "no valid policy loaded"
            raise PolicyError(msg)
        return self._current

    def load_first(self) -> LoadedPolicy:
        """The policy in force, reading the file when none is yet: a daemon's start-up.

        Raises:
            PolicyError: no policy in force and the file is invalid (a daemon cannot run
                without a policy), naming the file and its problems.
        """
        if self._current is None:
            result = self.reload()
            if self._current is None:
                problems = "; ".join(result.errors) or "unknown error"
                msg = f"policy {self._path} is invalid: {problems}"
                raise PolicyError(msg, problems=tuple(result.errors))
        return self._current

    def reload(self) -> ReloadResult:
        """Read the file again; on failure keep the last good policy and report why."""
        try:
            loaded = load_policy(self._path)
        except PolicyError as exc:
            return self._failed(exc, source=str(self._path))
        return self._accept(loaded)

    def replace(self, text: str, *, source: str) -> ReloadResult:
        """Put a policy received as text in force (e.g. pushed over MQTT), if valid."""
        try:
            loaded = parse_policy(text, source=source)
        except PolicyError as exc:
            return self._failed(exc, source=source)
        return self._accept(loaded)

    def _accept(self, loaded: LoadedPolicy) -> ReloadResult:
        previous = self._current
        if previous is not None and previous.revision == loaded.revision:
            return ReloadResult(changed=False, loaded=previous)
        self._current = loaded
        _log.info(
            "policy_loaded",
            source=loaded.source,
            policy=loaded.policy.name,
            revision=loaded.revision,
            previous_revision=previous.revision if previous else None,
        )
        return ReloadResult(changed=True, loaded=loaded)

    def _failed(self, exc: PolicyError, *, source: str) -> ReloadResult:
        kept = self._current
        _log.warning(
            "policy_reload_failed",
            source=source,
            problems=list(exc.problems),
            kept_revision=kept.revision if kept else None,
        )
        return ReloadResult(changed=False, loaded=kept, errors=exc.problems or (str(exc),))
