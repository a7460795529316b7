"""The ``file`` assignment source: a static YAML map of GPUs to priority classes.

One file may serve one node or a whole site::

    # every node: GPU 0 is high, the rest follow the policy
    gpus:
      "0": high
    # per node: merged over the top-level map (a node's entry wins for the same GPU)
    nodes:
      node1:
        gpus:
          "GPU-5d2b7c1e-0a7f-4e0c-9a51-0c3c2d1b9f00": low
          3: batch

A GPU is named by its index (``0``, ``"3"``) or its UUID (``GPU-...``, or a MIG device's
``MIG-...``), as the MQTT assignment names it; a class is a name of the wire's pattern
(letters, digits, ``_``, ``.``, ``:``, ``-``). Whether the class exists is the policy's
business: the agent refuses an update naming a class its policy lacks, as it refuses such
an MQTT assignment. An empty file assigns nothing.

The file is read through ``polca.yamlkit`` (bounded, duplicate keys refused). Every
problem with the text is reported at once, each at its ``FILE:LINE:COL`` (``YamlError``
and its ``lines()``); a file that cannot be read at all is a ``ConfigError``. Nothing else
is raised.

``watch_assignment`` loads the file, hands the update on, then reloads it on every change
(``polca.aiokit.watch_file``, which also sees replacement by rename). A bad edit is logged
and handed on as an unhealthy update that keeps the last good map; the next good edit
makes the source healthy again.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, NoReturn

import structlog
import yaml

from polca import aiokit, yamlkit
from polca.assign.model import AssignmentUpdate, Origin
from polca.errors import ConfigError, YamlError, YamlProblem

__all__ = [
    "MAX_GPUS",
    "MAX_NODES",
    "SOURCE",
    "gpu_key",
    "is_class_name",
    "load_assignment",
    "parse_assignment",
    "watch_assignment",
]

SOURCE: Final = "file"
ORIGIN: Final[Origin] = "file"
MAX_GPUS = 1024
"""GPU entries of one node's map, as many as the wire's assignment carries."""
MAX_NODES = 100_000
"""Nodes one site file may name."""
LIMITS = yamlkit.YamlLimits(max_bytes=4 * 1024 * 1024, max_depth=8, max_aliases=256)
"""A site's file: a few megabytes of plain maps, no deep nesting."""

_INDEX = re.compile(r"0|[1-9][0-9]{0,3}")
_UUID = re.compile(r"(GPU|MIG)-[A-Za-z0-9_.:/-]{1,124}")
_CLASS = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NODE = re.compile(r"[A-Za-z0-9_.-]{1,253}")
_MAX_PROBLEMS = 100
SECOND_LOOK_S = 1.0
"""After starting to watch, the file is read once more this much later."""


def gpu_key(value: object) -> str | None:
    """The assignment key of a GPU named by ``value`` (an index or a UUID); None if none.

    Indices are whole numbers up to 9999 written without leading zeros (``3`` or ``"3"``);
    UUIDs start with ``GPU-`` or ``MIG-``.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        return None
    if _INDEX.fullmatch(value) or _UUID.fullmatch(value):
        return value
    return None


def is_class_name(value: object) -> bool:
    """Whether ``value`` is a class name the wire schema accepts."""
    return isinstance(value, str) and _CLASS.fullmatch(value) is not None


def load_assignment(path: Path, node: str) -> AssignmentUpdate:
    """The classes the file at ``path`` gives ``node``'s GPUs.

    Raises:
        YamlError: the text is invalid (syntax, bounds, layout, names); ``lines()`` has
            one ``FILE:LINE:COL: message`` per problem.
        ConfigError: the file cannot be read (missing, unreadable, not UTF-8).
    """
    source = str(path)
    try:
        raw = yamlkit.read_bounded(path, LIMITS)
    except OSError as exc:
        msg = f"cannot read the assignment file {source}: {exc.strerror or exc}"
        raise ConfigError(msg) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"cannot read the assignment file {source}: not UTF-8 ({exc.reason})"
        raise ConfigError(msg) from exc
    return parse_assignment(text, node, source=source)


def parse_assignment(text: str, node: str, *, source: str) -> AssignmentUpdate:
    """``load_assignment`` for text already read; ``source`` names it in problems."""
    document = yamlkit.parse(text, source=source, limits=LIMITS)
    problems: list[YamlProblem] = []
    classes: dict[str, str] = {}
    root = document.node
    if root is not None:
        classes = _read_root(root, node, problems)
    if problems:
        ordered = sorted(problems, key=lambda p: (p.line or 0, p.column or 0))
        raise YamlError(source, tuple(ordered[:_MAX_PROBLEMS]))
    return AssignmentUpdate(source=SOURCE, classes=classes, origins=dict.fromkeys(classes, ORIGIN))


def _problem(node: yaml.Node, message: str) -> YamlProblem:
    mark = node.start_mark
    return YamlProblem(message, mark.line + 1, mark.column + 1)


def _items(
    node: yaml.Node, what: str, problems: list[YamlProblem]
) -> Iterator[tuple[yaml.Node, yaml.Node]]:
    """The (key node, value node) pairs of a mapping node; a problem if it is not one."""
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
        return  # ``gpus:`` with nothing after it: an empty map
    if not isinstance(node, yaml.MappingNode):
        problems.append(_problem(node, f"{what} must be a mapping (key: value)"))
        return
    yield from node.value


def _scalar(node: yaml.Node) -> str | None:
    """The text of a plain or quoted string or integer scalar (``3`` and ``"3"`` alike);
    None for anything else (booleans, nulls, floats, lists, mappings)."""
    if isinstance(node, yaml.ScalarNode) and node.tag in (
        "tag:yaml.org,2002:str",
        "tag:yaml.org,2002:int",
    ):
        return str(node.value)
    return None


def _read_root(root: yaml.Node, node: str, problems: list[YamlProblem]) -> dict[str, str]:
    top: dict[str, str] = {}
    own: dict[str, str] = {}
    for key, value in _items(root, "the assignment file", problems):
        name = _scalar(key)
        if name == "gpus":
            top = _read_gpus(value, "gpus", problems)
        elif name == "nodes":
            own = _read_nodes(value, node, problems)
        else:
            shown = key.value if isinstance(key, yaml.ScalarNode) else "a non-scalar key"
            problems.append(_problem(key, f"unknown key {shown!r}: expected gpus or nodes"))
    return {**top, **own}


def _read_nodes(value: yaml.Node, node: str, problems: list[YamlProblem]) -> dict[str, str]:
    mine: dict[str, str] = {}
    count = 0
    for key, entry in _items(value, "nodes", problems):
        count += 1
        if count > MAX_NODES:
            problems.append(_problem(key, f"more than {MAX_NODES} nodes"))
            break
        name = _scalar(key)
        if name is None or not _NODE.fullmatch(name):
            shown = key.value if isinstance(key, yaml.ScalarNode) else "a non-scalar key"
            problems.append(
                _problem(key, f"node name {shown!r}: use letters, digits, '_', '.', '-'")
            )
            continue
        classes: dict[str, str] = {}
        for field, gpus in _items(entry, f"nodes.{name}", problems):
            if _scalar(field) == "gpus":
                classes = _read_gpus(gpus, f"nodes.{name}.gpus", problems)
            else:
                shown = field.value if isinstance(field, yaml.ScalarNode) else "a non-scalar key"
                problems.append(
                    _problem(field, f"nodes.{name}: unknown key {shown!r}: expected gpus")
                )
        if name == node:
            mine = classes  # every node's entry is checked; this node's is kept
    return mine


def _read_gpus(value: yaml.Node, where: str, problems: list[YamlProblem]) -> dict[str, str]:
    classes: dict[str, str] = {}
    for key, cls in _items(value, where, problems):
        if len(classes) >= MAX_GPUS:
            problems.append(_problem(key, f"{where}: more than {MAX_GPUS} GPUs"))
            break
        gpu = gpu_key(_scalar(key))
        if gpu is None:
            shown = key.value if isinstance(key, yaml.ScalarNode) else "a non-scalar key"
            problems.append(
                _problem(
                    key,
                    f"{where}: {shown!r} is not a GPU: use its index (0, 1, ...) or its "
                    "UUID (GPU-... or MIG-...)",
                )
            )
            continue
        name = _scalar(cls)
        if not is_class_name(name):
            shown = cls.value if isinstance(cls, yaml.ScalarNode) else "a list or mapping"
            problems.append(
                _problem(
                    cls,
                    f"{where}.{gpu}: {shown!r} is not a class name (letters, digits, '_', "
                    "'.', ':', '-'; at most 128)",
                )
            )
            continue
        classes[gpu] = str(name)
    return classes


async def watch_assignment(
    path: Path,
    node: str,
    on_update: Callable[[AssignmentUpdate], None],
    *,
    debounce_s: float,
) -> NoReturn:
    """Hand ``node``'s map from ``path`` to ``on_update`` now and after every change.

    A file that cannot be read or is invalid is logged (``assignment_file_rejected``, each
    problem at its ``FILE:LINE:COL``) and handed on as an unhealthy update carrying the
    last good map (empty before the first good read). An update equal to the last one
    handed on (a touch, a rewrite with the same content) is not handed on again. The file
    is read once more ``SECOND_LOOK_S`` after the start, for an edit made while the
    watcher was being set up. Runs until cancelled; a failing watcher raises its error.
    """
    log = structlog.get_logger(__name__).bind(path=str(path), node=node)
    last_good: dict[str, str] = {}
    last_sent: AssignmentUpdate | None = None

    def reload() -> None:
        nonlocal last_good, last_sent
        try:
            update = load_assignment(path, node)
        except YamlError as exc:
            log.warning("assignment_file_rejected", problems=list(exc.lines()))
            update = _unhealthy(last_good, str(exc))
        except ConfigError as exc:
            log.warning("assignment_file_rejected", problems=[str(exc)])
            update = _unhealthy(last_good, str(exc))
        else:
            if update.classes != last_good or last_sent is None or not last_sent.healthy:
                log.info("assignment_file_loaded", gpus=len(update.classes))
            last_good = dict(update.classes)
        if update != last_sent:
            last_sent = update
            on_update(update)

    async def second_look() -> None:
        # An edit made after the first read but before the watcher was set up would be
        # missed until the next one: read once more when the watcher surely runs.
        await asyncio.sleep(SECOND_LOOK_S)
        reload()

    reload()
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(second_look())
            await aiokit.watch_file(path, debounce_s=debounce_s, action=reload)
    except* Exception as failed:
        raise failed.exceptions[0]  # noqa: B904 - the watcher's own error, not a group
    msg = f"the watcher of {path} ended"  # watch_file raises instead of returning
    raise RuntimeError(msg)


def _unhealthy(classes: dict[str, str], reason: str) -> AssignmentUpdate:
    return AssignmentUpdate(
        source=SOURCE,
        classes=dict(classes),
        origins=dict.fromkeys(classes, ORIGIN),
        healthy=False,
        reason=reason[:256],
    )
