"""What one call into the agent core hands its shell, gathered as the call goes (pure).

Every message the node publishes (state, event, telemetry) takes the next number of one
``seq`` that only ascends, and what a call queues (messages, in order, and the log lines of
the core's ``LogBook``) is handed over at its end as one ``Effects`` (``plans.py``), after
which the queues are empty. ``Outbox`` keeps that count and those queues, and builds the
node's events (``add_event``, with ``messages.event``), skipping one that does not fit the
wire with a log line (its number stays taken).

It changes when how the node numbers and hands over what it says changes, not when what it
says does (``messages.py`` builds the messages, ``core.py`` decides when to send them).
``AgentCore`` owns one; nothing here imports the core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from polca.agent import messages
from polca.agent.plans import Effects, LogBook
from polca.telemetry.messages import OutMessage
from polca.telemetry.topics import NodeAddress, Topics


class Outbox:
    """The node's message numbers, and what the current call has queued."""

    def __init__(self, addr: NodeAddress, topics: Topics, *, log: LogBook) -> None:
        """The outbox of the node at ``addr``; ``log`` is the core's, emptied by ``take``."""
        self.addr = addr
        self.topics = topics
        self.log = log
        self.seq = 0  # of the last message this node published (state, event, telemetry)
        self._messages: list[OutMessage] = []  # queued by this call, in order

    def next_seq(self) -> int:
        """The sequence number of the next message this node publishes."""
        self.seq += 1
        return self.seq

    def add(self, message: OutMessage) -> None:
        """Queue ``message`` (already numbered and stamped) after those queued before."""
        self._messages.append(message)

    def add_event(
        self,
        name: str,
        *,
        now_ns: int,
        gpu: int | None,
        uuid: str | None,
        detail: Mapping[str, Any],
    ) -> None:
        """Queue event ``name`` (of GPU ``gpu``, ``uuid``), stamped ``now_ns``, with the
        next ``seq``; logged and skipped if it does not fit the wire."""
        seq = self.next_seq()  # taken even when the event does not fit: seq only ascends
        try:
            message = messages.event(
                self.addr,
                self.topics,
                name,
                seq=seq,
                now_ns=now_ns,
                gpu=gpu,
                uuid=uuid,
                detail=detail,
            )
        except ValidationError as exc:
            self.log.warning("event_not_published", event_name=name, error=str(exc)[:400])
            return
        self._messages.append(message)

    def take(self, *, status_line: str | None = None) -> Effects:
        """Everything queued since the last ``take``, handed over with ``status_line``
        (systemd's new ``STATUS=``, None: unchanged); the queues are empty after."""
        out, self._messages = tuple(self._messages), []
        return Effects(messages=out, logs=self.log.take(), status_line=status_line)
