"""``polca aggregator``: parse its options, load its settings, run the aggregator.

The start-up is ``exits.run_process``'s (settings, logging, the exit code); this module
adds the command's options and what it runs: the InfluxDB and Prometheus sinks the
settings ask for, and the aggregator with its signal handlers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from polca import aiokit, logs
from polca.aggregator.config import AggregatorSettings
from polca.exits import run_process
from polca.settings import broker_override, load_settings_as


def add_parsers(subparsers: Any) -> None:
    """Add ``aggregator`` to the ``polca`` sub-command parsers."""
    p = subparsers.add_parser("aggregator", help="run the central aggregator")
    p.add_argument("--config", type=Path, default=None, help="YAML settings file")
    p.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    p.add_argument("--policy", type=Path, default=None, help="policy file")
    p.add_argument(
        "--observe",
        action="store_true",
        default=None,
        help="shadow mode: publish decisions marked observe",
    )
    p.add_argument("--duration", type=float, default=None)
    logs.add_options(p)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line overrides (nested dicts merge with other sources)."""
    over: dict[str, Any] = {}
    if args.broker:
        over["mqtt"] = broker_override(args.broker)
    if args.policy:
        over["policy_file"] = args.policy
    if args.observe:
        over["control"] = {"observe": True}
    log_over = {k: v for k, v in (("level", args.log_level), ("format", args.log_format)) if v}
    if log_over:
        over["logging"] = log_over
    return over


def main(args: argparse.Namespace) -> int:
    """Run ``polca aggregator``; returns the exit code."""
    return run_process(
        "aggregator",
        lambda: load_settings_as(AggregatorSettings, args.config, **overrides(args)),
        lambda settings: _run(settings, duration_s=args.duration),
    )


async def _run(settings: AggregatorSettings, *, duration_s: float | None) -> None:
    from polca.aggregator.runtime import Aggregator  # noqa: PLC0415 - only to run it
    from polca.export.influx import make_sink  # noqa: PLC0415
    from polca.export.prometheus import metrics_sinks  # noqa: PLC0415
    from polca.export.sink import Sink  # noqa: PLC0415

    sink = make_sink(settings.influx, state_dir=settings.state_dir)
    sinks: list[Sink] = [sink] if sink is not None else []
    sinks.extend(metrics_sinks(settings.metrics))
    aggregator = Aggregator(settings, sinks=sinks)
    aiokit.stop_on_signals(
        aggregator.stop_requested, aggregator.reload_requested, duration_s=duration_s
    )
    await aggregator.run()
