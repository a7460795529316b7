"""``polca agent``: parse its options, load the node's settings, run the agent.

The start-up is ``exits.run_process``'s (settings, logging, the exit code); this module
adds the command's options and what it runs: the GPU backend the settings name, the
policy, the Prometheus sink, and an in-process broker with ``--embedded-broker``.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from polca import aiokit, logs
from polca.agent.config import Settings, load_settings
from polca.exits import run_process
from polca.gpu import registry
from polca.settings import broker_override


def add_parsers(subparsers: Any) -> None:
    """Add ``agent`` to the ``polca`` sub-command parsers."""
    p = subparsers.add_parser("agent", help="run the node agent")
    p.add_argument("--config", type=Path, default=None, help="YAML settings file")
    p.add_argument("--backend", choices=registry.BACKEND_NAMES, default=None)
    p.add_argument("--policy", type=Path, default=None, help="policy file (agent.policy_file)")
    p.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    p.add_argument(
        "--embedded-broker",
        action="store_true",
        help="run an in-process MQTT broker and connect to it",
    )
    p.add_argument(
        "--observe-only", action="store_true", default=None, help="never write to the GPUs"
    )
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    logs.add_options(p)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line overrides (nested dicts merge with other sources)."""
    over: dict[str, dict[str, Any]] = {
        "gpu": {"backend": args.backend} if args.backend else {},
        "agent": {},
        "mqtt": broker_override(args.broker),
        "logging": {},
    }
    if args.policy:
        over["agent"]["policy_file"] = args.policy
    if args.observe_only is not None:
        over["agent"]["observe_only"] = args.observe_only
    if args.log_level:
        over["logging"]["level"] = args.log_level
    if args.log_format:
        over["logging"]["format"] = args.log_format
    return {k: v for k, v in over.items() if v}


def main(args: argparse.Namespace) -> int:
    """Run ``polca agent``; returns the exit code."""
    return run_process(
        "agent",
        lambda: load_settings(args.config, **overrides(args)),
        lambda settings: _run(
            settings, duration_s=args.duration, embedded_broker=args.embedded_broker
        ),
    )


async def _run(settings: Settings, *, duration_s: float | None, embedded_broker: bool) -> None:
    from polca.agent.runtime import Agent  # noqa: PLC0415 - the agent's code, only to run it
    from polca.export.prometheus import metrics_sinks  # noqa: PLC0415
    from polca.policy import PolicyStore  # noqa: PLC0415

    async with contextlib.AsyncExitStack() as stack:
        if embedded_broker:
            from polca.telemetry.broker import EmbeddedBroker  # noqa: PLC0415

            broker = await stack.enter_async_context(
                EmbeddedBroker(host=settings.mqtt.host, port=settings.mqtt.port)
            )
            settings = settings.model_copy(
                update={"mqtt": settings.mqtt.model_copy(update={"port": broker.port})}
            )
        agent = Agent(
            settings,
            backend=registry.make_backend(settings.gpu),
            policy_store=PolicyStore(settings.agent.policy_file),
            # The caps and their reasons are written whole each interval: a changed reason
            # replaces its series at once.
            sinks=metrics_sinks(settings.metrics, snapshots=frozenset({"gpu_cap"})),
        )
        aiokit.stop_on_signals(agent.stop_requested, agent.reload_requested, duration_s=duration_s)
        await agent.run()
