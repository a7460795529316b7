#!/usr/bin/env bash
# Set up and run polca's whole test suite on a fresh Debian machine:
# system packages (as root, or through sudo), a virtual environment, then lint, types,
# import contracts, generated-docs checks and the tests against a real Mosquitto,
# InfluxDB, VictoriaMetrics, etcd and Prometheus.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
[ -x /usr/bin/influxd ] || need+=(influxdb)
[ -x /usr/bin/victoria-metrics ] || need+=(victoria-metrics)
[ -x /usr/bin/etcd ] || need+=(etcd-server)
[ -x /usr/bin/prometheus ] || need+=(prometheus)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${need[@]}"
fi

# shellcheck source=scripts/venv.sh
. scripts/venv.sh
ensure_venv '.[test]'

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python -m pytest "$@"
