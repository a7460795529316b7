"""``polca status``'s rendering of the retained row summary (the CLI runs against real
brokers in tests/integration and tests/deploy)."""

from __future__ import annotations

import io

from polca.status import Snapshot, as_json, render
from polca.telemetry.bus import InMessage
from polca.telemetry.schema import RackSummary, RowSummary, encode
from polca.telemetry.topics import Topics


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
