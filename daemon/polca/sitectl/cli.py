"""``polca site check FILE...``: read a site file, print its tree or every problem in it.

Exit codes: 0 every file is a sound tree, 1 a file has problems (``FILE:LINE:COL: path:
message`` each, on stderr), 2 no file given (argparse).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from polca.powertree.sitefile import SiteFileError, describe, load_site

__all__ = ["add_parsers", "main", "run_check"]


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``polca site ...``."""
    site = sub.add_parser("site", help="the site's power tree (feeds, UPSes, switchboards)")
    ssub = site.add_subparsers(dest="site_command", required=True)
    check = ssub.add_parser(
        "check", help="validate site files and print their trees (FILE:LINE:COL errors)"
    )
    check.add_argument("files", nargs="+", type=Path)


def main(args: argparse.Namespace) -> int:
    """Run ``polca site``'s command."""
    return run_check(args.files, out=sys.stdout, err=sys.stderr)


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
