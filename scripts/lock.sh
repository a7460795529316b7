#!/usr/bin/env bash
# Refresh the locks in requirements/ (exact releases with hashes; requirements/README.md)
# from pyproject.toml and requirements/*.in, then say what changed in each.
#
#   ./scripts/lock.sh                          # add what pyproject.toml now asks for, keep every other pin
#   ./scripts/lock.sh --upgrade-package NAME   # NAME (and what it needs) to its newest release; repeatable
#   ./scripts/lock.sh --upgrade                # every package to its newest release the ranges allow
#
# Resolves with uv (universal: one lock for every Python from 3.11 and every platform), itself
# installed from requirements/lock-tools.txt into build/lock-venv. Needs the package index.
set -euo pipefail
cd "$(dirname "$0")/.."

tools=build/lock-venv
if ! "$tools/bin/uv" --version >/dev/null 2>&1; then
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install --quiet --require-hashes -r requirements/lock-tools.txt
fi

before=$(mktemp -d)
trap 'rm -rf "$before"' EXIT
cp requirements/*.txt "$before"/ 2>/dev/null || true

# compile OUT ARGS...: one lock; an existing OUT's pins are kept unless the arguments upgrade.
compile() {
  local out="requirements/$1"
  shift
  "$tools/bin/uv" pip compile --quiet --universal --python-version 3.11 --generate-hashes \
    --custom-compile-command ./scripts/lock.sh -o "$out" "$@"
}
# The test lock first: the runtime, demo and simulator locks are resolved under it, so a
# package has the same release in all of them.
compile test.txt pyproject.toml requirements/build.in --extra test "$@"
compile runtime.txt pyproject.toml requirements/build.in -c requirements/test.txt "$@"
compile demo.txt pyproject.toml requirements/build.in --extra embedded -c requirements/test.txt "$@"
compile sim.txt pyproject.toml requirements/build.in --extra sim -c requirements/test.txt "$@"
compile snmpsim.txt requirements/snmpsim.in "$@"
compile lock-tools.txt requirements/lock-tools.in "$@"

for lock in test runtime demo sim snmpsim lock-tools; do
  python3 scripts/locks.py diff --label "$lock" "$before/$lock.txt" "requirements/$lock.txt"
done
