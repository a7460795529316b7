"""The aggregator's messages stay within the wire's size, whatever the row."""

from __future__ import annotations

from polca.aggregator import messages
from polca.telemetry.schema import MAX_PAYLOAD_BYTES, RackSummary, RowSummary, decode


def test_a_summary_of_thousands_of_long_named_nodes_fits_the_wire() -> None:
    """4,096 offline nodes and 1,024 racks with 128-character names: cut to fit, flagged."""
    names = tuple(f"{i:04d}" + "n" * 124 for i in range(4096))
    racks = tuple(
        RackSummary(
            rack=f"{i:04d}" + "r" * 124,
            power_w=1e9,
            nodes_online=0,
            nodes_stale=0,
            nodes_offline=4,
        )
        for i in range(1024)
    )
    summary = RowSummary(
        ts_ns=1,
        row="row1",
        issuer="agg",
        power_w=1e12,
        power_source="computed",
        budget_w=1e9,
        effective_budget_w=1e9,
        level=3,
        racks=racks,
        offline_nodes=names,
        stale_nodes=names,
        implausible_nodes=names,
    )
    payload = messages._within_wire(summary)
    assert len(payload) <= MAX_PAYLOAD_BYTES
    decoded = decode(payload, RowSummary)
    assert decoded.truncated
    assert decoded.offline_nodes == names[: len(decoded.offline_nodes)]
    assert decoded.level == 3
    small = summary.model_copy(update={"racks": racks[:2], "offline_nodes": names[:3],
                                       "stale_nodes": (), "implausible_nodes": ()})  # fmt: skip
    assert not decode(messages._within_wire(small), RowSummary).truncated
