#!/usr/bin/env bash
# Set up polca and run its main job on embedded defaults, on a fresh Debian machine:
# python3-venv if missing (as root, or through sudo), a virtual environment with the exact
# releases of requirements/demo.txt (polca and its embedded MQTT broker), then `polca demo`
# (arguments are passed on, e.g. --duration 60).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends python3-venv
fi
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
ensure_venv requirements/demo.txt
exec .venv/bin/polca demo "$@"
