"""Poll a CDU over Modbus TCP: ``ModbusCduPoller``.

Why it exists: most CDUs in the field speak Modbus TCP, not MQTT. ``ModbusCduPoller``
reads the registers of a CDU's register map (``polca.cdu.registers``) in as few
requests as the map allows (``polca.modbus.registers.plan_reads``), over a
``polca.modbus.client.RegisterClient`` (``PymodbusClient`` unless a test gives another),
decodes them and returns a ``CduTelemetry``, which ``run_poller``
(``polca.cdu.publisher``) publishes like any CDU's own telemetry.

How it fails:

- Reconnection lives outside the client, as for MQTT (``polca.telemetry.bus``): a fresh
  client per connection, pymodbus' own reconnect and retries off. A poll that cannot
  connect, times out (``timeout_s`` bounds the connect and each read) or loses the
  connection drops the client and raises ``TransportError``; polls during the jittered,
  exponential backoff that follows raise at once, without touching the network.
- An outage is logged once (``modbus_unreachable``, warning) and its end once
  (``modbus_recovered``, info, with its length); the failed polls between are debug.
- A device that rejects the map (exception codes 1-3, ``polca.modbus.client``) raises
  ``ConfigError``; other exception codes (busy, gateway) are transient: ``TransportError``.
- A response of the wrong length (fewer or more registers than asked for) or with words
  outside 16 bits is a failed poll like a timeout (``TransportError``, counted in
  ``bad_responses`` and ``failures``): the connection is dropped, as the framing can no
  longer be trusted.
- A value that cannot be decoded (NaN, infinite, out of bounds, unknown state code) leaves
  its field out (states take their conservative value), is counted (``invalid_values``)
  and is logged once until it is good again (``modbus_value_invalid``). Decoding is total
  (``polca.modbus.registers``): no register value raises.

What it must not do: publish (the publisher does), or sleep between polls (the caller
schedules them).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from polca.cdu.outage import Outage
from polca.cdu.registers import ModbusCduConfig, assemble
from polca.errors import ConfigError, TransportError
from polca.modbus.client import PymodbusClient, RegisterClient
from polca.modbus.registers import DecodeProblem, ReadBlock, decode_point, plan_reads

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from polca.telemetry.schema import CduTelemetry

__all__ = ["ClientFactory", "ModbusCduPoller"]

ClientFactory = Callable[[ModbusCduConfig], RegisterClient]
"""Makes the client of one connection (``PymodbusClient``; tests script their own)."""


class ModbusCduPoller:
    """Polls one CDU over Modbus TCP and turns its registers into ``CduTelemetry``."""

    def __init__(
        self,
        config: ModbusCduConfig,
        *,
        client_factory: ClientFactory | None = None,
        time_ns: Callable[[], int] = time.time_ns,
        rng: random.Random | None = None,
        logger: FilteringBoundLogger | None = None,
    ) -> None:
        """Plan the reads of ``config``'s map; no I/O (the first ``poll()`` connects)."""
        self.config = config
        self.blocks: tuple[ReadBlock, ...] = plan_reads(
            config.points,
            max_gap=config.max_gap_registers,
            max_count=config.max_registers_per_read,
        )
        """The read requests of one poll, in order."""
        self._factory: ClientFactory = client_factory or PymodbusClient
        self._time_ns = time_ns
        self._rng = rng
        self._log: FilteringBoundLogger = (
            logger if logger is not None else structlog.get_logger(__name__)
        ).bind(cdu=config.cdu, host=config.host, port=config.port)
        self._client: RegisterClient | None = None
        self._outage = Outage(
            prefix="modbus",
            log=self._log,
            min_s=config.reconnect_min_s,
            max_s=config.reconnect_max_s,
            rng=rng,
        )
        self._invalid: set[str] = set()  # fields whose last value could not be decoded
        self.polls = 0
        """Successful polls."""
        self.failures = 0
        """Failed polls (each raised ``TransportError``)."""
        self.connects = 0
        """Connections made."""
        self.bad_responses = 0
        """Responses of the wrong length or with words outside 16 bits (each a failed poll)."""
        self.invalid_values = 0
        """Point values that could not be decoded, summed over polls."""

    @property
    def connected(self) -> bool:
        """Whether a connection is open (it may still turn out to be broken)."""
        return self._client is not None

    @property
    def in_outage(self) -> bool:
        """Whether the last poll failed."""
        return self._outage.since is not None

    async def poll(self) -> CduTelemetry:
        """Read every register of the map once; the CDU's telemetry.

        Raises ``TransportError`` (with ``delay_s`` until the next connection attempt)
        while the device is unreachable, and ``ConfigError`` when it rejects the map.
        """
        loop = asyncio.get_running_loop()
        timeout_s = self.config.timeout_s
        client = self._client
        if client is None:
            wait_s = self._outage.wait_s(loop.time())
            if wait_s > 0:
                self.failures += 1
                self._outage.skipped()
                msg = (
                    f"Modbus device {self.config.host}:{self.config.port} unreachable; "
                    f"next attempt in {wait_s:.1f} s"
                )
                raise TransportError(msg, delay_s=wait_s)
            client = self._factory(self.config)
            try:
                async with asyncio.timeout(timeout_s):
                    await client.connect()
            except (TransportError, TimeoutError) as exc:
                client.close()
                raise self._failure(exc, loop.time()) from exc
            self._client = client
            self.connects += 1
            self._log.debug("modbus_connected")
        values: dict[str, float | str | DecodeProblem] = {}
        try:
            for block in self.blocks:
                async with asyncio.timeout(timeout_s):
                    registers = await client.read(block.table, block.address, block.count)
                self._check_response(block, registers)
                for point in block.points:
                    start = point.address - block.address
                    values[point.field] = decode_point(
                        point,
                        registers[start : start + point.width],
                        word_order=self.config.word_order,
                    )
        except (TransportError, TimeoutError) as exc:
            # A late answer must not be taken for the next request's: new connection.
            self._drop_client()
            raise self._failure(exc, loop.time()) from exc
        except ConfigError:
            self._drop_client()
            raise
        self._note_problems(values)
        self._outage.recovered(loop.time())
        self.polls += 1
        return assemble(self.config, values, ts_ns=self._time_ns())

    def close(self) -> None:
        """Close the connection, if any (the next poll reconnects)."""
        self._drop_client()

    # -- internals ------------------------------------------------------------------------

    def _check_response(self, block: ReadBlock, registers: Sequence[object]) -> None:
        """Refuse a response that does not answer ``block``: ``TransportError``."""
        where = f"Modbus device {self.config.host}:{self.config.port}"
        problem = None
        if len(registers) != block.count:
            problem = (
                f"returned {len(registers)} registers for a read of {block.count} "
                f"{block.table} registers at {block.address}"
            )
        elif not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w <= 0xFFFF for w in registers
        ):
            problem = (
                f"returned a value that is not a 16-bit word reading {block.table} registers "
                f"at {block.address}"
            )
        if problem is not None:
            self.bad_responses += 1
            msg = f"{where} {problem}"
            raise TransportError(msg)

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _failure(self, exc: BaseException, now: float) -> TransportError:
        """Count a failed poll, schedule the next attempt, log once per outage."""
        self.failures += 1
        error = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else type(exc).__name__)
        delay_s = self._outage.failed(error, now)
        msg = f"Modbus CDU {self.config.cdu} at {self.config.host}:{self.config.port}: {error}"
        return TransportError(msg, delay_s=delay_s)

    def _note_problems(self, values: dict[str, float | str | DecodeProblem]) -> None:
        """Log a field that cannot be decoded when it goes bad, and when it is good again."""
        for field, value in values.items():
            if isinstance(value, DecodeProblem):
                self.invalid_values += 1
                if field not in self._invalid:
                    self._invalid.add(field)
                    self._log.warning(
                        "modbus_value_invalid", field=field, raw=value.raw, reason=value.reason
                    )
            elif field in self._invalid:
                self._invalid.discard(field)
                self._log.info("modbus_value_valid", field=field)
