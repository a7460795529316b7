#!/usr/bin/env bash
# Make .snmpsim-venv: snmpsim (the SNMP agent the meter tests talk to) in a venv built with
# Debian's /usr/bin/python3, not the test venv's Python.
#
# Why a second venv: snmpsim refuses to run as root unless it drops to
# --process-user=nobody --process-group=nogroup, and as nobody it cannot read a Python
# under /root (pyenv's, which .venv uses). Debian's /usr/bin/python3 and a venv under the
# world-readable checkout can be run by nobody. Its releases are requirements/snmpsim.txt's
# (hash-checked; requirements/snmpsim.in says why each is there).
# Idempotent: does nothing when the responder already runs from that lock.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.snmpsim-venv
if [ -x "$venv/bin/snmpsim-command-responder" ] \
  && "$venv/bin/snmpsim-command-responder" --version >/dev/null 2>&1 \
  && cmp -s requirements/snmpsim.txt "$venv/polca-lock.txt"; then
  exit 0
fi
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
need_python_venv /usr/bin/python3
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --require-hashes -r requirements/snmpsim.txt
"$venv/bin/python" -m pip check >/dev/null
cp requirements/snmpsim.txt "$venv/polca-lock.txt"
# nobody must be able to read and run everything in it.
chmod -R a+rX "$venv"
"$venv/bin/snmpsim-command-responder" --version >/dev/null
