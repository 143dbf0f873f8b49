#!/usr/bin/env bash
# All tests, from a fresh clone too: sets up first (incremental), then pytest. Extra arguments go to pytest;
# --fast runs the fast tier only (-m "not slow"; tests/conftest.py says which tests are slow).
# The tests run in NBL_TEST_WORKERS processes (pytest-xdist; default: the cores, at most 4), one thread of
# compute each: most tests are one Python thread, so one process left a core of two idle (tests/conftest.py
# keeps each file, and the files that share a fixture of the session, in one process). 1: no workers.
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
# the unpatched libllama, for the test that a stock GGUF is unchanged by the patch; ggml's operator test,
# and a check of the patched CPU kernel
cmake --build "${NBL_GGUF_BUILD:-$root/build}" --target llama-stock nbl-test-backend-ops nbl-flash-attn-paths -j "$(nproc)"
cd "$root"
workers=${NBL_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
if [ "$workers" -gt 1 ]; then
    args=(-n "$workers" --dist loadgroup ${args[@]+"${args[@]}"})
fi
exec "$root/.venv/bin/python" -m pytest -q ${args[@]+"${args[@]}"}
