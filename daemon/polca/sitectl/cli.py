"""``polca site``: the site's power tree and its controller.

- ``polca site check FILE...``: read a site file, print its tree or every problem in it.
  Exit codes: 0 every file is a sound tree, 1 a file has problems (``FILE:LINE:COL: path:
  message`` each, on stderr), 2 no file given (argparse).
- ``polca site run --config FILE``: the site controller (``sitectl/runtime.py``): reads the
  meters and the rows' summaries, shares each domain's live capacity by priority and
  publishes each row's leased budget; the leader writes the tree's points to the sinks
  ``influx`` and ``metrics.address`` ask for. Exit codes as every daemon's
  (``polca.exits``): 78 for a bad configuration or site file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import structlog

from polca import logs
from polca.exits import run_process
from polca.powertree.sitefile import SiteFileError, describe, load_site

if TYPE_CHECKING:
    from polca.export.sink import Sink
    from polca.sitectl.config import SiteSettings

__all__ = ["add_parsers", "main", "run_check"]


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``polca site ...``."""
    site = sub.add_parser("site", help="the site's power tree (feeds, UPSes, switchboards)")
    ssub = site.add_subparsers(dest="site_command", required=True)
    check = ssub.add_parser(
        "check", help="validate site files and print their trees (FILE:LINE:COL errors)"
    )
    check.add_argument("files", nargs="+", type=Path)
    run = ssub.add_parser("run", help="the site controller: share the capacity, lease budgets")
    run.add_argument("--config", type=Path, default=None, help="YAML settings file")
    run.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    run.add_argument("--site", default=None, help="site name (default: settings, 'site')")
    run.add_argument("--interval", type=float, default=None, help="allocation period in s")
    run.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    logs.add_options(run)


def main(args: argparse.Namespace) -> int:
    """Run ``polca site``'s command."""
    if args.site_command == "run":
        return run_process("site", lambda: _settings(args), lambda s: _run(args, s))
    return run_check(args.files, out=sys.stdout, err=sys.stderr)


def _settings(args: argparse.Namespace) -> SiteSettings:
    from polca.settings import load_source_settings  # noqa: PLC0415
    from polca.sitectl.config import SiteSettings  # noqa: PLC0415

    return load_source_settings(SiteSettings, args)


async def _run(args: argparse.Namespace, settings: SiteSettings) -> None:
    from polca.sitectl.runtime import SiteController  # noqa: PLC0415

    try:
        tree = load_site(settings.tree_file)
    except SiteFileError as exc:  # every problem in the journal, then exit 78
        log = structlog.get_logger()
        for problem in exc.problems:
            log.error("site_file_problem", problem=problem)
        raise
    await SiteController(settings, tree, sinks=_sinks(settings)).run(duration_s=args.duration)


def _sinks(settings: SiteSettings) -> list[Sink]:
    """The InfluxDB and Prometheus sinks the settings ask for (none by default).

    Each step's points are the whole tree, so ``/metrics`` replaces the tree's series at
    every write (``PrometheusSink`` snapshots): a limit cleared goes at once."""
    from polca.export.influx import make_sink  # noqa: PLC0415
    from polca.export.prometheus import metrics_sinks  # noqa: PLC0415
    from polca.sitectl.points import TREE_MEASUREMENTS  # noqa: PLC0415

    sink = make_sink(settings.influx, state_dir=settings.state_dir)
    sinks: list[Sink] = [sink] if sink is not None else []
    sinks.extend(metrics_sinks(settings.metrics, snapshots=TREE_MEASUREMENTS))
    return sinks


def run_check(paths: Sequence[Path], *, out: TextIO, err: TextIO) -> int:
    """Each file's tree to ``out``, or its problems to ``err``; 0 when all are sound."""
    failed = False
    for path in paths:
        try:
            tree = load_site(path)
        except SiteFileError as exc:
            failed = True
            for problem in exc.problems:
                err.write(f"{problem}\n")
            continue
        feeds = sum(len(d.feeds) for d in tree.domains.values())
        out.write(
            f"{path}: ok ({len(tree.domains)} domains, {feeds} feeds, {len(tree.rows)} rows)\n"
        )
        for line in describe(tree):
            out.write(f"  {line}\n")
    return 1 if failed else 0
