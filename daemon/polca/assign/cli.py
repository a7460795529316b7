"""``polca assign``: the command line of the scheduler's hook (``assign/publish.py`` does it).

Only the parser lives here, so that ``polca`` does not load MQTT, the wire schema and the
settings for every other command: ``main`` imports ``assign/publish.py`` when the command
runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_parsers", "main"]


def add_parsers(subparsers: Any) -> None:
    """Add ``assign`` to the ``polca`` sub-command parsers."""
    p = subparsers.add_parser(
        "assign",
        help="set, change or clear a node's GPU priority classes (a batch scheduler's hook)",
    )
    p.add_argument("--node", default=None, help="the node's name (its agent's topics.node)")
    p.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="UUID|INDEX",
        help="a GPU of the node (repeatable, or comma-separated)",
    )
    p.add_argument("--class", dest="cls", default=None, help="the class these GPUs get")
    p.add_argument(
        "--clear",
        action="store_true",
        help="without --class: remove these GPUs' entries (every entry without --gpu); "
        "with --class: remove every other entry",
    )
    p.add_argument("--config", type=Path, default=None, help="YAML settings (mqtt, site)")
    p.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    p.add_argument("--site", default=None, help="site name (default: settings, 'site')")
    p.add_argument("--row", default=None, help="the node's row (default: from its status)")
    p.add_argument("--rack", default=None, help="the node's rack (default: from its status)")
    p.add_argument("--username", default=None, help="MQTT user (mqtt.username)")
    p.add_argument(
        "--password-file",
        type=Path,
        default=None,
        help="file holding the MQTT password (first line); or POLCA_MQTT__PASSWORD",
    )
    p.add_argument(
        "--timeout",
        default="5",
        help="seconds to reach the broker, find the node and see the map back (default 5)",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``polca assign`` (``polca.assign.publish.run``); returns the exit code."""
    from polca.assign.publish import run  # noqa: PLC0415 - MQTT and pydantic, when used

    return run(args)
