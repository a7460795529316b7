"""Fuzzing the wire: the decoder is total and strict, and no payload breaks a handler.

Structured mutations of valid messages (``tests/wire_fuzz.py``) and raw bytes go through
``decode`` (only ``SchemaError`` may escape, and what must be refused is refused) and
through the message handlers of a real agent and a real aggregator, built in-process on
every topic each subscribes to: nothing escapes them, and nothing is counted ``internal``
(an unexpected exception caught by the last-resort guard). The budget is fixed for CI;
``bench/fuzz_wire.py`` runs the same engine over 100,000+ payloads.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.agent.config import Settings
from polca.agent.runtime import Agent
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.runtime import Aggregator
from polca.errors import SchemaError
from polca.export.sink import MemorySink
from polca.gpu.simulated import SimulatedBackend
from polca.policy import PolicyStore
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import decode, encode
from polca.telemetry.topics import NodeAddress, Topics
from tests.fuzzing import FUZZ
from tests.wire_fuzz import KINDS, Mutant, check, mutate, valid_messages

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "policies" / "polca-a100.yaml"
SITE, ROW, RACK, NODE = "dc1", "row1", "rack1", "node1"
VALID = valid_messages()


def _agent(tmp_path: Path) -> Agent:
    settings = Settings(
        topics={"site": SITE, "row": ROW, "rack": RACK, "node": NODE},
        agent={"policy_file": POLICY, "state_dir": tmp_path / "agent"},
    )
    store = PolicyStore(POLICY)
    store.reload()
    return Agent(settings, backend=SimulatedBackend(count=2), policy_store=store)


def _aggregator(tmp_path: Path) -> Aggregator:
    settings = AggregatorSettings(
        site=SITE,
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path / "aggregator",
        rows=[
            {
                "name": ROW,
                "budget_w": 20_000,
                "fallback_budget_w": 12_000,
                "feeds": [
                    {"name": "A", "rating_w": 12_000, "sources": ["pdu-a"]},
                    {"name": "B", "rating_w": 12_000, "sources": ["pdu-b"]},
                ],
                "racks": [{"name": RACK, "nodes": [{"name": NODE}, {"name": "node2"}]}],
            }
        ],
        cooling={
            "loops": [
                {
                    "name": "loop1",
                    "cdu": "cdu1",
                    "racks": [RACK],
                    "heat_capacity_kw": 100,
                    "design_flow_lpm": 150,
                }
            ]
        },
    )
    aggregator = Aggregator(settings, sinks=[MemorySink(max_points=10_000)])
    aggregator.policy_store.reload()
    return aggregator


def _agent_topics() -> list[str]:
    topics = Topics()
    addr = NodeAddress(SITE, ROW, RACK, NODE)
    return [
        topics.row_control(SITE, ROW),
        topics.rack_control(SITE, ROW, RACK),
        topics.policy(SITE, ROW),
        topics.node(addr, "assign"),
    ]


def _aggregator_topics() -> list[str]:
    topics = Topics()
    addr = NodeAddress(SITE, ROW, RACK, NODE)
    return [
        *(topics.node(addr, channel) for channel in ("telemetry", "status", "state", "events")),
        topics.row_control(SITE, ROW),
        topics.rack_control(SITE, ROW, RACK),
        topics.meter(SITE, ROW),
        topics.budget(SITE, ROW),
        topics.cdu(SITE, "cdu1"),
    ]


def _mutants(seed: int, count: int) -> Iterator[Mutant]:
    rng = random.Random(seed)  # noqa: S311 - reproducible mutations, not secrets
    for _ in range(count):
        kind = rng.choice(KINDS)
        yield mutate(rng, kind, VALID[kind])


def test_every_valid_message_round_trips() -> None:
    """The fuzzer's seeds decode to themselves: its mutations start from valid payloads."""
    for kind, message in VALID.items():
        assert decode(encode(message)) == message, kind


@FUZZ
@given(seed=st.integers(min_value=0, max_value=2**32))
def test_mutated_messages_are_refused_when_they_must_be(seed: int) -> None:
    """25 mutations per example: only SchemaError escapes; no must-refuse payload decodes."""
    for mutant in _mutants(seed, 25):
        _, finding = check(mutant, decode, SchemaError)
        assert finding is None, finding


@FUZZ
@given(payload=st.binary(max_size=2048))
def test_random_bytes_raise_only_schema_error(payload: bytes) -> None:
    """Arbitrary bytes either decode or raise SchemaError."""
    with contextlib.suppress(SchemaError):
        decode(payload)


@FUZZ
@given(
    text=st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=30,
    ).map(repr)
)
def test_python_literals_as_payloads_raise_only_schema_error(text: str) -> None:
    """JSON-like but not always JSON text (Python reprs) is refused cleanly or decodes."""
    with contextlib.suppress(SchemaError):
        decode(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_payload_breaks_the_agent_handlers(tmp_path: Path, seed: int) -> None:
    """400 mutants on each agent topic, live and retained: none escapes, none is internal."""
    agent = _agent(tmp_path)
    now = time.time_ns()
    for i, mutant in enumerate(_mutants(seed, 400)):
        for topic in _agent_topics():
            agent.handle_message(InMessage(topic, mutant.payload, i % 2 == 0, now, 1))
    assert agent.core.drops.counts["internal"] == 0, agent.core.drops.counts
    assert agent.core.drops.total > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_payload_breaks_the_aggregator_intake(tmp_path: Path, seed: int) -> None:
    """400 mutants on each aggregator topic, live and retained: none escapes, none is internal."""
    aggregator = _aggregator(tmp_path)
    now = time.time_ns()
    for i, mutant in enumerate(_mutants(seed, 400)):
        for topic in _aggregator_topics():
            aggregator.handle_message(InMessage(topic, mutant.payload, i % 2 == 0, now, 1))
    assert aggregator.intake.dropped["internal"] == 0, aggregator.intake.dropped
    assert aggregator.intake.messages_in == 400 * len(_aggregator_topics())
