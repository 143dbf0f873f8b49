#!/usr/bin/env bash
# The GPU half of the benchmark suite (docs/results/bench-cpu.md has the CPU half): NBL against
# stock llama.cpp with CUDA, on a machine with an NVIDIA GPU, from the repository root.
#
#   bash scripts/gpu_bench.sh [STAGE ...]        default: all = build models 8b hf 1b
#
# Stages (each fits in a 10-minute call on an H100; run them back to back, they reuse each other's files):
#   pack    (on the development machine, before going to the GPU machine, which has no network)
#           packs the patched llama.cpp tree into .carry/llama.cpp-src.tar.xz (~9 MB; .carry/ is
#           git-ignored: name it in the device tool's `carry`)
#   build   CUDA build of the patched llama.cpp into $NBL_GGUF_BUILD (default build-cuda): by
#           scripts/build_llama.sh when the llama-cpp-python sdist is at hand, else by plain cmake
#           from the packed tree; also puts gguf-py on PYTHONPATH for the later stages
#   models  makes the Llama-3.1-8B-shaped random-weight q4_k_m GGUFs: stock and NBL m=12 of 32
#   8b      bench on CUDA: pp512 and tg128 at depths 0, 2048, 8192, 32768, 2 interleaved rounds
#   hf      the HF transformers model (random weights, same shape, apply_nbl with the GGUF's NBL
#           layers, bf16) against llama.cpp at depth 0 on CUDA (--hf-compare)
#   1b      Llama-3.2-1B shape, q4_k_m, m=6 of 16: CPU (-ngl 0 -dev none) and CUDA (-ngl 99) side by side
#
# Environment: RESULTS (default $OUT/gpu-bench when the device tool sets OUT, else bench-results/gpu),
# NBL_GGUF_BUILD (default build-cuda), PYTHON (default .venv/bin/python, else python3),
# CUDA_ARCH (default 90: H100/H200), BENCH_WORK (GGUF cache, default /tmp/nbl-bench-work).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export NBL_GGUF_BUILD=${NBL_GGUF_BUILD:-$root/build-cuda}
results=${RESULTS:-${OUT:+$OUT/gpu-bench}}
results=${results:-$root/bench-results/gpu}
work=${BENCH_WORK:-/tmp/nbl-bench-work}
arch=${CUDA_ARCH:-90}
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON=$root/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
packed=$root/.carry/llama.cpp-src.tar.xz

# gguf-py from the pinned tree when the environment has no gguf package (the GPU image has none)
if ! "$PYTHON" -c "import gguf" 2>/dev/null; then
    for src in "$NBL_GGUF_BUILD/llama.cpp-src" "$root/build/llama.cpp-src"; do
        if [ -d "$src/gguf-py" ]; then export PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"; break; fi
    done
fi

log() { echo "gpu_bench: $*" >&2; }
bench() { "$PYTHON" -m nbl_gguf bench --work-dir "$work" "$@"; }

stage_pack() {
    local src=$root/build/llama.cpp-src
    [ -f "$src/CMakeLists.txt" ] || { log "no patched tree in $src: run scripts/build_llama.sh first"; exit 1; }
    mkdir -p "$root/.carry"
    tar -C "$root/build" --exclude='llama.cpp-src/models' --exclude='llama.cpp-src/docs' \
        --exclude='llama.cpp-src/benches' --exclude='llama.cpp-src/tests' --exclude='llama.cpp-src/.git' \
        -cJf "$packed" llama.cpp-src
    log "packed $(du -h "$packed" | cut -f1) into $packed: carry .carry to the GPU machine"
}

stage_build() {
    nvidia-smi -L
    if [ -x "$NBL_GGUF_BUILD/bin/llama-bench" ] && "$NBL_GGUF_BUILD/bin/llama-bench" --list-devices 2>&1 | grep -q CUDA; then
        log "CUDA build already in $NBL_GGUF_BUILD"; return
    fi
    local sdist=${NBL_DOWNLOAD_DIR:-$HOME/.cache/nbl-gguf}/llama_cpp_python-0.3.36.tar.gz
    if [ -f "$sdist" ]; then
        GGML_CUDA=ON NBL_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch ${NBL_CMAKE_ARGS:-}" PYTHON=$PYTHON \
            bash "$root/scripts/build_llama.sh"
    elif [ -f "$packed" ]; then
        # the packed tree is the patched llama.cpp itself: build the tools the bench needs into bin/
        mkdir -p "$NBL_GGUF_BUILD"
        [ -f "$NBL_GGUF_BUILD/llama.cpp-src/CMakeLists.txt" ] || tar -C "$NBL_GGUF_BUILD" -xJf "$packed"
        local gen=() noamx=()
        # as the top-level CMakeLists.txt does: no AMX kernels (SIGILL on VMs that list AMX in CPUID)
        [ "$(uname -m)" = x86_64 ] && noamx=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                                             -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
        command -v ninja >/dev/null 2>&1 && [ ! -f "$NBL_GGUF_BUILD/CMakeCache.txt" ] && gen=(-G Ninja)
        cmake -S "$NBL_GGUF_BUILD/llama.cpp-src" -B "$NBL_GGUF_BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF \
            -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_RPATH='$ORIGIN' "${noamx[@]}"
        cmake --build "$NBL_GGUF_BUILD" --target llama-bench llama-quantize -j "$(nproc)"
        export PYTHONPATH="$NBL_GGUF_BUILD/llama.cpp-src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
    else
        log "neither the sdist ($sdist) nor $packed: run 'bash scripts/gpu_bench.sh pack' where the build exists"
        exit 1
    fi
    "$NBL_GGUF_BUILD/bin/llama-bench" --list-devices
}

stage_models() {
    "$PYTHON" - "$work" <<'EOF'
import sys
from nbl_gguf.fixtures import synthetic
shape = synthetic.get_shape("llama-3.1-8b")
print(synthetic.make_pair(shape, "q4_k_m", [12], f"{sys.argv[1]}/synthetic", log=lambda m: print(m, flush=True)))
EOF
}

stage_8b() {
    bench --shape llama-3.1-8b --m 12 --quant q4_k_m --backends cuda -d 0,2048,8192,32768 -p 512 -n 128 \
        --rounds 2 -r 2 -o "$results/llama-3.1-8b-q4_k_m-cuda"
}

stage_hf() {
    bench --shape llama-3.1-8b --m 12 --quant q4_k_m --backends cuda -d 0 -p 512 -n 128 --rounds 2 -r 2 \
        --hf-compare --device cuda --dtype bf16 -o "$results/llama-3.1-8b-hf-compare"
}

stage_1b() {
    bench --shape llama-3.2-1b --m 6 --quant q4_k_m --backends cpu,cuda -d 0,2048,8192 -p 512 -n 64 \
        --rounds 2 -r 1 -o "$results/llama-3.2-1b-q4_k_m-cpu-cuda"
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(all)
for stage in "${stages[@]}"; do
    case $stage in
        all) stage_build; stage_models; stage_8b; stage_hf; stage_1b ;;
        pack|build|models|8b|hf|1b) log "stage $stage"; "stage_$stage" ;;
        *) log "unknown stage '$stage' (pack, build, models, 8b, hf, 1b, all)"; exit 2 ;;
    esac
done
log "results in $results"
