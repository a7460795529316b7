# shellcheck shell=bash
# Sourced by demo.sh and test.sh: make .venv usable for polca, rebuilding it when an earlier
# setup was cut short (a venv without pip, or one polca cannot be imported from) instead of
# failing on it every time after.

# ensure_venv TARGET: a working .venv with TARGET installed (pip's argument, e.g. '.[test]').
ensure_venv() {
  local target="$1"
  if [ -e .venv ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    echo "polca: .venv has no working python or pip (an interrupted setup?): rebuilding it" >&2
    rm -rf .venv
  fi
  [ -e .venv ] || python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e "$target"
  if ! .venv/bin/python -c 'import polca' >/dev/null 2>&1; then
    echo "polca: polca cannot be imported from .venv: rebuilding it" >&2
    rm -rf .venv
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e "$target"
    .venv/bin/python -c 'import polca'
  fi
}
