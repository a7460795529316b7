# shellcheck shell=bash
# Sourced by demo.sh and test.sh: make a venv usable for polca, rebuilding it when
# an earlier setup was cut short (a venv without pip, or one polca cannot be imported from)
# instead of failing on it every time after.

# need_python_venv [PYTHON]: PYTHON (default python3) can make venvs, installing Debian's
# python3-venv (as root, or through sudo) when it cannot.
need_python_venv() {
  local python="${1:-python3}"
  if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends python3-venv
  fi
}

# _polca_install_locked VENV LOCK: every pin of LOCK (hash-checked: a release or file the
# lock does not name is refused), then polca from this checkout, editable, resolving nothing
# (its build backend is in the lock too, so no unlocked release enters through a build
# environment); pip check then says whether the venv is whole.
_polca_install_locked() {
  local venv="$1" lock="$2"
  "$venv/bin/python" -m pip install --quiet --require-hashes -r "$lock" &&
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e . &&
    "$venv/bin/python" -m pip check >/dev/null
}

# ensure_venv LOCK [VENV]: a working VENV (default .venv) with polca and the exact releases
# of LOCK (a hashed lock in requirements/, e.g. requirements/test.txt). A venv made earlier
# is brought to the lock's releases; one left broken, or one whose packages conflict after
# that (made from another lock), is rebuilt from nothing.
ensure_venv() {
  local lock="$1" venv="${2:-.venv}"
  if [ -e "$venv" ] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "polca: $venv has no working python or pip (an interrupted setup?): rebuilding it" >&2
    rm -rf "$venv"
  fi
  [ -e "$venv" ] || python3 -m venv "$venv" || return 1
  if ! _polca_install_locked "$venv" "$lock" || ! "$venv/bin/python" -c 'import polca' >/dev/null 2>&1; then
    echo "polca: $venv does not hold $lock with a working polca: rebuilding it" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" || return 1
    _polca_install_locked "$venv" "$lock" || return 1
    "$venv/bin/python" -c 'import polca' || return 1
  fi
}
