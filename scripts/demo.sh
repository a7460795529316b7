#!/usr/bin/env bash
# Set up polca and run its main job on embedded defaults, on a fresh Debian machine:
# python3-venv if missing (as root, or through sudo), a virtual environment with the exact
# releases of requirements/demo.txt (polca and its embedded MQTT broker), then `polca demo`
# (arguments are passed on, e.g. --duration 60).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/venv.sh
. scripts/venv.sh
need_python_venv
ensure_venv requirements/demo.txt
exec .venv/bin/polca demo "$@"
