#!/usr/bin/env bash
# All tests, from a fresh clone too: sets up first (incremental), then pytest. Extra arguments go to pytest;
# --fast runs the fast tier only (-m "not slow"; tests/conftest.py says which tests are slow).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
args=()
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then
        args+=(-m "not slow")
    else
        args+=("$arg")
    fi
done
bash "$root/scripts/setup.sh" --no-run
# the unpatched libllama, for the test that a stock GGUF is unchanged by the patch
cmake --build "${NBL_GGUF_BUILD:-$root/build}" --target llama-stock -j "$(nproc)"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q ${args[@]+"${args[@]}"}
