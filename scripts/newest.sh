#!/usr/bin/env bash
# Run the whole suite on the newest releases the declared ranges in pyproject.toml allow,
# not on the lock: what the next `./scripts/lock.sh --upgrade` would bring, found on purpose
# by whoever asks rather than by a new user. Needs the package index. Makes
# build/newest-venv anew, prints each package whose newest release differs from
# requirements/test.txt, then runs scripts/test.sh (system packages, lint, types, import
# contracts, the tests under coverage) in it. Arguments go to pytest. Leaves the locks and
# .venv as they are.
#
#   ./scripts/newest.sh                 # everything (as long as scripts/test.sh)
#   ./scripts/newest.sh tests/assign    # some of it
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
need_python_venv
# polca's test extra at the newest releases pyproject.toml's ranges allow: no lock, on purpose.
venv=build/newest-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
"$venv/bin/python" -m pip install --quiet -e '.[test]'
"$venv/bin/python" -m pip check
"$venv/bin/python" -m pip freeze --all --exclude-editable >"$venv/newest-pins.txt"
echo "polca: the newest releases against requirements/test.txt:"
"$venv/bin/python" scripts/locks.py diff --here --label newest \
  requirements/test.txt "$venv/newest-pins.txt"
POLCA_TEST_VENV="$venv" exec ./scripts/test.sh "$@"
