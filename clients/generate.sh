#!/usr/bin/env bash
# Generates the Python gRPC stubs of convene from proto/convene/v1 into
# clients/python/gen (not committed; see clients/.gitignore), where
# clients/python/payment_incident.py imports them.
#
#   clients/generate.sh            # from anywhere; takes about a second
#
# Python: the interpreter is $CONVENE_TEST_PYTHON, else the repository's .venv/bin/python,
# else python3; it needs the packages of clients/python/requirements.txt
# (`python -m pip install -r clients/python/requirements.txt`). The stubs are written to a
# fresh directory and swapped in whole, so a failed run leaves the previous ones as they were.
#
# Node: nothing to generate. clients/node/payment_incident.js loads proto/ at run time
# with @grpc/proto-loader; `npm ci` in clients/node installs its packages.
set -euo pipefail

clients="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$clients")"

python="${CONVENE_TEST_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then
    python="$root/.venv/bin/python"
  else
    python="python3"
  fi
fi
if ! "$python" -c 'import grpc, grpc_tools, yaml' 2>/dev/null; then
  echo "generate.sh: $python lacks grpcio, grpcio-tools or PyYAML; install them with:" >&2
  echo "  $python -m pip install -r $clients/python/requirements.txt" >&2
  exit 1
fi

out="$clients/python/gen"
tmp="$(mktemp -d "$clients/python/.gen.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# grpc_tools ships the well-known types (google/protobuf/*.proto) on its include path.
(cd "$root/proto" && "$python" -m grpc_tools.protoc -I . \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  convene/v1/*.proto)
chmod 755 "$tmp"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "generate.sh: Python stubs of $(ls "$root"/proto/convene/v1/*.proto | wc -l) proto files in $out"
