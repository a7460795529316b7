"""Outbox: one ascending ``seq`` for the node's messages, and effects handed over whole."""

from __future__ import annotations

from polca.agent.outbox import Outbox
from polca.agent.plans import LogBook
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Event, decode
from polca.telemetry.topics import NodeAddress, Topics

ADDR = NodeAddress("dc1", "row1", "rack1", "n1")
TOPICS = Topics()


def test_events_take_the_next_seq_even_when_one_does_not_fit() -> None:
    """An event the wire refuses is logged and skipped, its number stays taken: the next
    message's ``seq`` still ascends past it."""
    outbox = Outbox(ADDR, TOPICS, log=LogBook())
    outbox.add_event("gpu_lost", now_ns=5, gpu=1, uuid="GPU-1", detail={"error": "x" * 5000})
    outbox.add_event("gpu_lost", now_ns=6, gpu=2, uuid="GPU-2", detail={"error": "gone"})
    assert outbox.next_seq() == 3
    effects = outbox.take()
    (message,) = effects.messages
    event = decode(message.payload, Event)
    assert (event.seq, event.gpu, event.uuid, event.ts_ns) == (2, 2, "GPU-2", 6)
    assert dict(event.detail) == {"error": "gone"}
    assert message.topic == TOPICS.node(ADDR, "events")
    assert [line.event for line in effects.logs] == ["event_not_published"]


def test_take_hands_over_everything_queued_in_order_and_empties_the_queues() -> None:
    """Messages in the order queued, the log lines written since, the status line given;
    a second take is empty (the ``seq`` goes on)."""
    log = LogBook()
    outbox = Outbox(ADDR, TOPICS, log=log)
    first = OutMessage("a", b"1", qos=1)
    outbox.add(first)
    outbox.add_event("fail_safe_entered", now_ns=1, gpu=None, uuid=None, detail={})
    log.info("something")
    effects = outbox.take(status_line="ok")
    assert effects.messages[0] is first
    assert decode(effects.messages[1].payload, Event).event == "fail_safe_entered"
    assert [line.event for line in effects.logs] == ["something"]
    assert effects.status_line == "ok"
    again = outbox.take()
    assert (again.messages, again.logs, again.status_line) == ((), (), None)
    assert outbox.seq == 1
