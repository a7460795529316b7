"""``polca status``: the rendering of the retained row summary, and failing fast, in one
line with a distinct exit code, when the broker is away, silent or refuses the user (the
CLI runs against real brokers in tests/integration and tests/deploy too)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time

from polca.status import Snapshot, as_json, render
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import RackSummary, RowSummary, encode
from polca.telemetry.topics import Topics
from tests.mqtt_broker import MosquittoFactory


def test_a_row_names_its_offline_stale_and_implausible_nodes() -> None:
    """The row line lists every node the row cannot take at its word, with why."""
    summary = RowSummary(
        ts_ns=1,
        row="row1",
        issuer="agg1",
        power_w=15_000.0,
        power_source="computed",
        budget_w=2e7,
        effective_budget_w=2e7,
        level=0,
        racks=(
            RackSummary(
                rack="rack1", power_w=15_000.0, nodes_online=2, nodes_stale=1, nodes_offline=1
            ),
        ),
        offline_nodes=("n1",),
        stale_nodes=("n2",),
        implausible_nodes=("n4",),
    )
    snapshot = Snapshot()
    topics = Topics()
    snapshot.add(topics, InMessage("polca/v1/dc1/row1/summary", encode(summary), True, 0))
    out = io.StringIO()
    render(snapshot, now_ns=2, out=out)
    text = out.getvalue()
    assert "n1 (offline), n2 (stale), n4 (implausible)" in text
    assert "20000.0 kW" in text  # a budget beyond one node's wire bound is carried
    rows = as_json(snapshot, now_ns=2)["rows"]
    assert rows[0]["implausible_nodes"] == ["n4"]
    assert "power:" not in text  # no note: the row runs on its meter, or has none


def test_a_row_says_why_it_does_not_run_on_its_meter() -> None:
    """The summary's power_note, on a line of its own under the row."""
    note = "meter reading 4400 W below the nodes' own power (floor 5220 W)"
    summary = RowSummary(
        ts_ns=1,
        row="row1",
        issuer="agg1",
        power_w=5_800.0,
        power_source="computed",
        power_note=note,
        budget_w=6_400.0,
        effective_budget_w=6_400.0,
        level=2,
        racks=(),
    )
    snapshot = Snapshot()
    snapshot.add(Topics(), InMessage("polca/v1/dc1/row1/summary", encode(summary), True, 0))
    out = io.StringIO()
    render(snapshot, now_ns=2, out=out)
    assert f"  power: {note}\n" in out.getvalue()


def test_a_row_says_where_its_budget_comes_from_and_which_feeds_are_down() -> None:
    """A row on a feed's capacity, with a lease above it: the origin, the leased budget."""
    summary = RowSummary(
        ts_ns=1,
        row="row1",
        issuer="agg1",
        power_w=5_800.0,
        power_source="meter",
        budget_w=10_000.0,
        effective_budget_w=6_000.0,
        electrical_budget_w=6_000.0,
        budget_origin="feeds",
        budget_limited_by="feed B",
        leased_budget_w=8_000.0,
        feeds={"A": True, "B": False},
        level=2,
        racks=(),
    )
    snapshot = Snapshot()
    snapshot.add(Topics(), InMessage("polca/v1/dc1/row1/summary", encode(summary), True, 0))
    out = io.StringIO()
    render(snapshot, now_ns=2, out=out)
    text = out.getvalue()
    assert "  budget: 6.0 kW from feeds (feed B); configured 10.0 kW, leased 8.0 kW\n" in text
    assert "  feeds down: B\n" in text


def _status(
    *args: str, secret: str | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``polca status ARGS`` as a user runs it; its result and how long it took."""
    env = {**os.environ}
    if secret is not None:
        env["POLCA_MQTT__PASSWORD"] = secret
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "polca", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    return done, time.monotonic() - started


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_an_unreachable_broker_fails_fast_with_one_line() -> None:
    """Nothing listening: exit 69, one line naming the broker, no retries, under seconds."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free, and nobody listens once closed
    done, took_s = _status("--broker", f"127.0.0.1:{port}")
    assert done.returncode == 69
    assert f"127.0.0.1:{port}" in _one_line(done)
    assert took_s < 10


def test_a_broker_that_never_answers_times_out_with_one_line() -> None:
    """A port that accepts and stays silent: exit 69 after --timeout, naming the wait."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        done, took_s = _status("--broker", f"127.0.0.1:{port}", "--timeout", "1")
    assert done.returncode == 69
    line = _one_line(done)
    assert f"127.0.0.1:{port}" in line
    assert 1 <= took_s < 15


def test_refused_credentials_fail_with_77(mosquitto_factory: MosquittoFactory) -> None:
    """A broker refusing the user: exit 77 and one line naming the user, not a retry loop."""
    right, wrong = "right", "wrong"  # a test broker's password, and another
    broker = mosquitto_factory(users={"viewer": right})
    done, _ = _status(
        "--broker", f"{broker.host}:{broker.port}", "--username", "viewer", secret=wrong
    )
    assert done.returncode == 77
    assert "viewer" in _one_line(done)
    ok, _ = _status(
        "--broker", f"{broker.host}:{broker.port}", "--username", "viewer", secret=right
    )
    assert ok.returncode == 0, ok.stderr
