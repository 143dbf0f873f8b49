#!/usr/bin/env bash
# Build the loader fuzzer (fuzz/CMakeLists.txt) into build-fuzz/, or into $NBL_FUZZ_BUILD.
#
# The patched llama.cpp tree comes from the regular build ($NBL_GGUF_BUILD, default build/, made by
# scripts/build_llama.sh): its configure step, rerun here, extracts the pinned llama.cpp and applies
# patches/ again whenever they changed.
# Needs clang and its sanitizer and libFuzzer runtimes (Debian: clang libclang-rt-14-dev).
#
#   JOBS   parallel compile jobs (default: all cores)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${NBL_GGUF_BUILD:-$root/build}
fuzz_build=${NBL_FUZZ_BUILD:-$root/build-fuzz}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}

for tool in clang clang++ cmake; do
    command -v "$tool" >/dev/null || { echo "nbl: $tool not found (Debian: apt-get install clang libclang-rt-14-dev cmake)" >&2; exit 1; }
done

if [ ! -f "$build/CMakeCache.txt" ]; then
    echo "nbl: no regular build in $build: run scripts/build_llama.sh first" >&2
    exit 1
fi
echo "nbl: patching llama.cpp in $build (configure step of the regular build)"
cmake -S "$root" -B "$build" >/dev/null

args=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DNBL_LLAMA_SRC="$build/llama.cpp-src")
if command -v ninja >/dev/null 2>&1 && [ ! -f "$fuzz_build/CMakeCache.txt" ]; then
    args+=(-G Ninja)
fi
echo "nbl: building the fuzzer in $fuzz_build"
cmake -S "$root/fuzz" -B "$fuzz_build" "${args[@]}"
cmake --build "$fuzz_build" --target fuzz-load-model -j "${JOBS:-$(nproc)}"
echo "nbl: $fuzz_build/fuzz-load-model"
