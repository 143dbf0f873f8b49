#!/usr/bin/env bash
# All tests, from a fresh clone too: sets up first (incremental), then pytest. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh" --no-run
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
