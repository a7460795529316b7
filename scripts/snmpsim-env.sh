#!/usr/bin/env bash
# Make .snmpsim-venv: snmpsim (the SNMP agent the meter tests talk to) in a venv built with
# Debian's /usr/bin/python3, not the test venv's Python.
#
# Why a second venv: snmpsim refuses to run as root unless it drops to
# --process-user=nobody --process-group=nogroup, and as nobody it cannot read a Python
# under /root (pyenv's, which .venv uses). Debian's /usr/bin/python3 and a venv under the
# world-readable checkout can be run by nobody. pysmi is an undeclared dependency of
# snmpsim 1.2.2; cryptography gives pysnmp its SNMPv3 privacy ciphers (AES, DES).
# Idempotent: does nothing when the responder already runs.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.snmpsim-venv
if [ -x "$venv/bin/snmpsim-command-responder" ] \
  && "$venv/bin/snmpsim-command-responder" --version >/dev/null 2>&1 \
  && "$venv/bin/python" -c "import cryptography, pysmi" 2>/dev/null; then
  exit 0
fi
if ! /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends python3-venv
fi
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "snmpsim==1.2.2" pysmi cryptography
# nobody must be able to read and run everything in it.
chmod -R a+rX "$venv"
"$venv/bin/snmpsim-command-responder" --version >/dev/null
