"""A node's event names never become new series: ``kind`` takes only the agent's own names."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from polca.aggregator import points
from polca.export.points import encode_lines
from polca.export.schema import SCHEMA
from polca.telemetry.schema import Event, decode, encode

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "daemon" / "polca" / "agent"


def _event(name: str, **detail: str | int) -> Event:
    return Event(ts_ns=7_000_000, seq=1, node="n01", event=name, gpu=2, detail=detail)


def _literal_names(expression: ast.expr) -> list[str] | None:
    """The names a literal, or a conditional of literals, can be; None for anything else."""
    if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
        return [expression.value]
    if isinstance(expression, ast.IfExp):
        body, orelse = _literal_names(expression.body), _literal_names(expression.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _published_names() -> dict[str, list[str]]:
    """Every event name the agent's source publishes, with where; fails on a dynamic name.

    A call ``<x>.event(NAME, ...)`` outside ``messages.event`` (the builder, which takes the
    core first) publishes an event; NAME must be string literals (a conditional of them is
    fine), so that this test sees every name the agent can publish.
    """
    found: dict[str, list[str]] = {}
    for path in sorted(AGENT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "event"
            ):
                continue
            receiver = node.func.value
            if isinstance(receiver, ast.Name) and receiver.id == "messages":
                continue  # the builder: AgentCore.event hands its name through
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            assert node.args, f"{where}: an event without a positional name"
            literals = _literal_names(node.args[0])
            assert literals is not None, f"{where}: an event name that is not a literal"
            for literal in literals:
                found.setdefault(literal, []).append(where)
    return found


def test_every_name_the_agent_publishes_is_a_known_kind() -> None:
    """NODE_EVENT_KINDS is exactly what the agent's source publishes (add new names there)."""
    published = _published_names()
    unknown = {
        name: where for name, where in published.items() if name not in points.NODE_EVENT_KINDS
    }
    assert not unknown, (
        f"add these agent events to aggregator/points.py NODE_EVENT_KINDS: {unknown}"
    )
    assert set(published) == points.NODE_EVENT_KINDS  # and no stale name in the set
    assert points.OTHER_EVENT_KIND not in points.NODE_EVENT_KINDS


def test_the_source_scan_sees_a_conditional_name() -> None:
    """The scan reads both names of ``"a" if x else "b"`` (cap_reasserted / cap_changed)."""
    published = _published_names()
    assert {"cap_changed", "cap_reasserted", "gpu_lost", "policy_rejected"} <= set(published)


@pytest.mark.parametrize("name", sorted(points.NODE_EVENT_KINDS))
def test_known_names_keep_their_kind(name: str) -> None:
    """An event the agent publishes is tagged with its own name, the text as before."""
    point = points.event_point(_event(name), site="s", row="r", rack="k")
    assert point.tags["kind"] == name
    assert point.fields["text"] == f"n01: {name} gpu 2"
    detail = point.fields["detail"]
    assert isinstance(detail, str)
    assert "event" not in json.loads(detail)


@pytest.mark.parametrize("name", ["gpu_exploded", "level_changed", "other", "Cap_Changed"])
def test_unknown_names_become_other_and_keep_the_name_in_the_fields(name: str) -> None:
    """A name the agent never publishes (also the aggregator's own level_changed) is `other`."""
    point = points.event_point(_event(name, xid=79), site="s", row="r", rack="k")
    assert point.tags["kind"] == "other"
    assert point.fields["text"] == f"n01: {name} gpu 2: xid=79"
    detail = point.fields["detail"]
    assert isinstance(detail, str)
    assert json.loads(detail) == {"event": name, "xid": 79}
    assert set(point.tags) == set(SCHEMA["event"].tags)


def test_a_hostile_name_of_128_chars_never_becomes_a_tag() -> None:
    """The longest name the wire allows: no tag holds it, the text holds a cut copy."""
    hostile = "x" * 64 + "_y.z:-" + "w" * 58
    assert len(hostile) == 128
    event = decode(encode(_event(hostile, note="n" * 60)), Event)  # valid on the wire
    point = points.event_point(event, site="s", row="r", rack="k")
    assert point.tags["kind"] == "other"
    assert all(hostile not in value for value in point.tags.values())
    line = encode_lines([point]).decode()
    head = line.split(" ", 1)[0]  # measurement and tags: no space is left unescaped there
    assert head == "event,kind=other,node=n01,rack=k,row=r,site=s"
    text = point.fields["text"]
    assert isinstance(text, str)
    assert text.startswith("n01: " + hostile[:63] + "… gpu 2: note=")
    assert hostile not in text
    assert len(text) <= 256
    detail = point.fields["detail"]
    assert isinstance(detail, str)
    assert json.loads(detail)["event"] == hostile


def test_a_node_cannot_replace_the_name_through_its_detail() -> None:
    """A detail key ``event`` of the node's gives way to the real name."""
    point = points.event_point(_event("made_up", event="cap_changed"), site="s", row="r", rack="k")
    assert point.tags["kind"] == "other"
    detail = point.fields["detail"]
    assert isinstance(detail, str)
    assert json.loads(detail)["event"] == "made_up"


def test_thousands_of_new_names_make_one_series_per_node() -> None:
    """2,500 events with new names: one (node, kind) series, not 2,500."""
    heads = {
        encode_lines([points.event_point(_event(f"flood_{i}"), site="s", row="r", rack="k")]).split(
            b" ", 1
        )[0]
        for i in range(2500)
    }
    assert heads == {b"event,kind=other,node=n01,rack=k,row=r,site=s"}
