"""Read the locks in requirements/: what changed between two, and a lock's entries by name.

    python3 scripts/locks.py diff OLD NEW [--label NAME] [--here]
    python3 scripts/locks.py pick LOCK NAME [NAME ...]

``diff`` reads each file's ``name==version`` lines (two locks, or a lock and ``pip freeze``;
hashes, comments and markers are left aside; names compared in their normalised form) and
prints one line per change: ``name old -> new``, ``+ name version`` for an added package,
``- name version`` for a removed one, or ``no change``; it exits 0 either way (scripts/lock.sh,
scripts/newest.sh). With ``--here`` the locks' environment markers are evaluated for the
running interpreter (``packaging`` needed), so a universal lock's entries for other Pythons
or platforms do not count as changes. ``pick`` prints the named packages' entries with their
hashes, a lock of its own for ``pip install --require-hashes`` (scripts/floors.sh); exit 1
naming any missing.
Standard library only (but ``--here``): it runs under any python3 before a venv exists.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
_MARKER = re.compile(r";\s*(.*?)\s*\\?\s*$")


def normalise(name: str) -> str:
    """A distribution name as PyPI compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies_here(line: str) -> bool:
    """Whether the entry's environment marker (if any) holds for this interpreter."""
    from packaging.markers import Marker  # noqa: PLC0415 - only for --here

    marker = _MARKER.search(line)
    return marker is None or Marker(marker.group(1)).evaluate()


def pins(text: str, *, here: bool = False) -> dict[str, str]:
    """``name -> version`` of every pin in a lock or freeze output (with ``here``, only the
    entries whose marker holds for this interpreter). A name a universal lock pins twice
    (one release per environment marker) maps to its releases joined by ``|``."""
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = _PIN.match(line.strip())
        if match and (not here or _applies_here(line)):
            found.setdefault(normalise(match.group(1)), set()).add(match.group(2))
    return {name: "|".join(sorted(versions)) for name, versions in found.items()}


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The lines that say how ``new`` differs from ``old``, sorted by name."""
    lines: list[str] = []
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if before is None:
            lines.append(f"+ {name} {after}")
        elif after is None:
            lines.append(f"- {name} {before}")
        else:
            lines.append(f"{name} {before} -> {after}")
    return lines


def entries(text: str, names: set[str]) -> tuple[str, set[str]]:
    """The lock's entries (requirement line and its continuation lines) for ``names``, and
    the names it has no entry for."""
    kept: list[str] = []
    found: set[str] = set()
    keep = False
    for line in text.splitlines():
        match = _PIN.match(line)
        if match:
            keep = normalise(match.group(1)) in names
            if keep:
                found.add(normalise(match.group(1)))
        elif not line.startswith((" ", "\t")):
            keep = False
        if keep and not line.lstrip().startswith("#"):
            kept.append(line)
    return "\n".join(kept) + "\n", names - found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    diff = verbs.add_parser("diff", help="what changed from OLD to NEW")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    diff.add_argument("--label", default=None, help="name printed before each line")
    diff.add_argument(
        "--here", action="store_true", help="only the entries whose markers hold here"
    )
    pick = verbs.add_parser("pick", help="the entries of the named packages")
    pick.add_argument("lock", type=Path)
    pick.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    if args.verb == "pick":
        text, missing = entries(
            args.lock.read_text(encoding="utf-8"), {normalise(n) for n in args.names}
        )
        if missing:
            print(
                f"locks: {args.lock} has no entry for {', '.join(sorted(missing))}", file=sys.stderr
            )
            return 1
        sys.stdout.write(text)
        return 0
    old = pins(args.old.read_text(encoding="utf-8"), here=args.here) if args.old.exists() else {}
    new = pins(args.new.read_text(encoding="utf-8"), here=args.here)
    lines = changes(old, new)
    label = f"{args.label}: " if args.label else ""
    if not lines:
        print(f"{label}no change")
    for line in lines:
        print(f"{label}{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
