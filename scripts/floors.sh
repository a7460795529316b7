#!/usr/bin/env bash
# Test the declared lower bounds: install every dependency of pyproject.toml at exactly
# its floor (">=X" becomes "==X") in a throwaway virtual environment, then run the unit
# tests that exercise each library (the bus and embedded broker, settings, the policy
# engine, the agent and aggregator cores, the InfluxDB transport, Modbus, SNMP, Redfish).
# The test tools (pytest, hypothesis, ...) and pip are the lock's (requirements/test.txt),
# so that only polca's own floors differ from the usual run; grpcio-tools, which must match
# grpcio, goes to its floor with it. What those need is left to the resolver.
# Needs network access to the package index:
# ./scripts/floors.sh
# (./scripts/newest.sh is its counterpart: the newest releases the ranges allow.)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/floors-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --require-hashes \
  -r <(python3 scripts/locks.py pick requirements/test.txt pip packaging)
constraints=build/floors-constraints.txt
"$venv/bin/python" - "$constraints" "$venv/bin/python" <<'PY'
# The lowest released version of each dependency at or above its declared floor; the test
# extra's other packages at the lock's release.
import re, subprocess, sys, tomllib
from packaging.utils import canonicalize_name
from packaging.version import Version
data = tomllib.load(open("pyproject.toml", "rb"))
deps = list(data["project"]["dependencies"])
for extra in ("embedded", "sim"):
    deps += data["project"]["optional-dependencies"][extra]
FLOORED_TOOLS = {"grpcio-tools"}  # must match grpcio, which goes to its floor
deps += [d for d in data["project"]["optional-dependencies"]["test"]
         if canonicalize_name(re.split(r"[<>=\[;]", d)[0]) in FLOORED_TOOLS]
floored = {canonicalize_name(re.split(r"[<>=\[;]", d)[0]) for d in deps}
locked = {}
for line in open("requirements/test.txt"):
    m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", line)
    if m:
        locked[canonicalize_name(m.group(1))] = m.group(2)
pins = []
for dep in data["project"]["optional-dependencies"]["test"]:
    name = canonicalize_name(re.split(r"[<>=\[;]", dep)[0])
    if name not in floored:
        pins.append(f"{name}=={locked[name]}")
for dep in deps:
    m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9][^,;]*)", dep)
    if not m:
        continue
    name, floor = m.group(1), Version(m.group(3))
    listing = subprocess.run(
        [sys.argv[2], "-m", "pip", "index", "versions", name],
        capture_output=True, text=True, check=True,
    ).stdout
    available = listing.split("Available versions:", 1)[1].splitlines()[0]
    versions = sorted(Version(v.strip()) for v in available.split(",") if v.strip())
    lowest = min(v for v in versions if v >= floor and not v.is_prerelease)
    pins.append(f"{name}=={lowest}")
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
print("floors:", " ".join(pins))
PY
"$venv/bin/python" -m pip install --quiet -c "$constraints" -e '.[test]'
# The committed JSON Schema of the policy is generated with current versions (pydantic's
# schema output changes between releases), so its equality check is left out here.
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/telemetry tests/policy tests/agent tests/aggregator tests/export tests/test_settings.py \
  tests/cooling tests/cdu tests/plant tests/coord/test_leadership.py tests/meter tests/redfish \
  tests/bmc \
  --deselect tests/policy/test_shipped.py::test_doc_schema_is_current "$@"
