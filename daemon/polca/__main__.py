"""``python -m polca``: the same entry point as the ``polca`` console script."""

from polca.cli import main

raise SystemExit(main())
