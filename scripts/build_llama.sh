#!/usr/bin/env bash
# Build the patched llama.cpp (top-level CMakeLists.txt) into build/, or into $NBL_GGUF_BUILD.
#
#   GGML_CUDA=ON|OFF   force the CUDA backend on or off; by default it is on when nvcc and a GPU
#                      are both present (CI builds the CPU backend only)
#   NBL_CMAKE_ARGS     extra arguments for the configure step
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${NBL_GGUF_BUILD:-$root/build}
python=${PYTHON:-$(command -v python3)}
# ccache keys on paths relative to the checkout, so a fresh clone elsewhere reuses the cache
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}

if [ -z "${GGML_CUDA:-}" ]; then
    if command -v nvcc >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        GGML_CUDA=ON
    else
        GGML_CUDA=OFF
    fi
fi

args=(-DCMAKE_BUILD_TYPE=Release -DGGML_CUDA="$GGML_CUDA" -DPython3_EXECUTABLE="$python")
if command -v ninja >/dev/null 2>&1 && [ ! -f "$build/CMakeCache.txt" ]; then
    args+=(-G Ninja)
fi
# shellcheck disable=SC2206
args+=(${NBL_CMAKE_ARGS:-})

echo "nbl: building patched llama.cpp in $build (GGML_CUDA=$GGML_CUDA)"
cmake -S "$root" -B "$build" "${args[@]}"
cmake --build "$build" --target nbl-tools -j "$(nproc)"
echo "nbl: tools in $build/bin"
