#!/usr/bin/env bash
# Regenerate the Python stubs of the kubelet's pod-resources API (daemon/polca/assign/_pb)
# from the vendored proto (daemon/polca/assign/proto/podresources_v1.proto) with grpcio-tools
# (the test extra). Run after changing the proto or upgrading grpcio-tools, then commit the
# result; tests/assign/test_podresources.py::test_stubs_are_current runs this script into a
# temporary folder and fails while the committed stubs differ from what it writes.
#
#   ./scripts/gen-podresources.sh            # writes daemon/polca/assign/_pb
#   ./scripts/gen-podresources.sh OUT_DIR    # writes the generated files into OUT_DIR only
#
# PYTHON names the interpreter with grpcio-tools (default .venv/bin/python); PROTO another
# proto to compile (default the vendored one; the test compiles a changed copy).
#
# The proto is compiled as "api.proto" (the kubelet's own file name) so that the modules are
# api_pb2.py, api_pb2.pyi and api_pb2_grpc.py. protoc writes `import api_pb2` in
# api_pb2_grpc.py, a top-level import that only works with _pb on sys.path; it is rewritten
# to the package-relative `from . import api_pb2` here, so regenerating is reproducible.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
proto="${PROTO:-$root/daemon/polca/assign/proto/podresources_v1.proto}"
out="${1:-$root/daemon/polca/assign/_pb}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$proto" "$work/api.proto"
(
    cd "$work"
    "$python" -m grpc_tools.protoc -I. \
        --python_out=. --pyi_out=. --grpc_python_out=. api.proto
)
sed -i 's/^import api_pb2 as api__pb2$/from . import api_pb2 as api__pb2/' "$work/api_pb2_grpc.py"
if ! grep -q '^from \. import api_pb2 as api__pb2$' "$work/api_pb2_grpc.py"; then
    echo "gen-podresources: the generated import in api_pb2_grpc.py changed form;" \
        "update the rewrite in $0" >&2
    exit 1
fi
for name in api_pb2.py api_pb2.pyi api_pb2_grpc.py; do
    cp "$work/$name" "$out/$name"
done
