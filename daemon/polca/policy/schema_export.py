"""Regenerate the policy schema embedded in Markdown documents (docs/policy.md).

``python -m polca.policy.schema_export docs/policy.md`` rewrites the block between the
schema markers; with ``--check`` it only reports (exit 1) when a block is stale. Kept apart
from ``polca.policy.schema`` so that ``python -m`` does not import this module twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

from polca.policy.schema import with_schema


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check``, verify) the schema block of the given documents."""
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    paths = [Path(arg) for arg in args if arg != "--check"]
    if not paths:
        sys.stderr.write("usage: python -m polca.policy.schema_export [--check] FILE.md...\n")
        return 2
    stale = 0
    for path in paths:
        document = path.read_text(encoding="utf-8")
        updated = with_schema(document)
        if updated == document:
            continue
        if check:
            sys.stderr.write(f"{path}: the embedded policy schema is out of date\n")
            stale += 1
        else:
            path.write_text(updated, encoding="utf-8")
            sys.stdout.write(f"{path}: schema updated\n")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
