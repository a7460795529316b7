"""An in-process MQTT broker for the README demo, so a first run needs no Mosquitto.

Why it exists: ``polca agent --backend simulated --embedded-broker`` should show the whole
loop (telemetry, retained status, Last Will) on a laptop with nothing installed beyond
``pip install 'polca[embedded]'``. It wraps the pure-Python ``amqtt`` broker, the only
module importing it, so the dependency stays optional and replaceable.

Limits (amqtt 0.12), verified by ``tests/telemetry/test_broker.py``:

- MQTT 3.1.1 only: MQTT 5 clients are refused (CONNACK "unsupported protocol version",
  which ``MqttBus`` turns into ``ConfigError``). Use ``mqtt.protocol: "3.1.1"`` with it.
- Anonymous access, loopback by default, no TLS, no persistence: a demo, not production.
  Production uses Mosquitto (``deploy/``).
- Retained messages and the Last Will (retained too) work.
- A connecting client may receive retained messages for filters that *other* sessions
  subscribed to (amqtt replays retained messages for every known subscription to a new
  session); consumers filter by topic anyway (``topic_matches``).
- A TCP connection that closes before sending CONNECT (a port probe) leaks its transport
  inside amqtt (a ResourceWarning at garbage collection); probe with an MQTT client instead.

What it must not do: be used by the aggregator or agent in production, or log at info
level (amqtt logs every connection; its loggers are set to warning).
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, Self

from polca.errors import FatalError

__all__ = ["EmbeddedBroker"]

_LISTENER = "default"
# amqtt's and its state machine library's loggers: quiet unless something is wrong.
_NOISY_LOGGERS = ("amqtt", "transitions")


class EmbeddedBroker:
    """An anonymous MQTT 3.1.1 broker on ``host:port`` while the context is entered.

    ``port=0`` lets the kernel pick a free port; read it from ``broker.port`` after
    entering. Construction does no I/O.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._broker: Any = None

    @property
    def url(self) -> str:
        """``mqtt://host:port`` (the real port once started)."""
        return f"mqtt://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        """Start listening; raises FatalError if amqtt is missing or the port is taken."""
        try:
            from amqtt.broker import Broker  # noqa: PLC0415 - optional dependency
            from amqtt.errors import BrokerError  # noqa: PLC0415
        except ImportError as exc:
            msg = (
                "the embedded MQTT broker needs the optional amqtt package: "
                "pip install 'polca[embedded]' (or point mqtt.host at a Mosquitto broker)"
            )
            raise FatalError(msg) from exc
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)

        config = {
            "listeners": {_LISTENER: {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            # An explicit plugin list: amqtt's defaults add $SYS publishing (which warns
            # about psutil) and packet logging.
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }
        broker = Broker(config)
        try:
            await broker.start()
        except BrokerError as exc:
            msg = f"cannot start the embedded MQTT broker on {self.host}:{self.port}: {exc}"
            raise FatalError(msg) from exc
        self._broker = broker
        self.port = _bound_port(broker, self.port)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Disconnect every client and stop listening."""
        broker, self._broker = self._broker, None
        if broker is not None:
            await broker.shutdown()


def _bound_port(broker: Any, requested: int) -> int:
    """The port the listener really bound (the kernel's pick when ``requested`` is 0).

    amqtt has no public accessor for it: read the asyncio server of our listener.
    """
    if requested:
        return requested
    server = getattr(broker, "_servers", {}).get(_LISTENER)
    sockets = getattr(getattr(server, "instance", None), "sockets", None)
    if not sockets:
        msg = "cannot tell which port the embedded MQTT broker bound; give mqtt.port explicitly"
        raise FatalError(msg)
    port: int = sockets[0].getsockname()[1]
    return port
