#!/usr/bin/env bash
# The GPU half of the measurements (docs/results/bench-cpu.md and scale-cpu.md have the CPU half), on a
# machine with an NVIDIA GPU and no network, from the repository root. docs/results/gpu.md has the figures.
#
#   bash scripts/gpu_bench.sh [STAGE ...]        default: all
#
# Stages (all = build models calibrate bench8b taps taps8b tests stream spill):
#   pack       (on the development machine, after scripts/setup.sh) puts into .carry/ (git-ignored; name it
#              in the device tool's `carry`): the build folder's patched llama.cpp tree with its stamp, so
#              the top-level CMakeLists.txt builds it without the sdist (~13 MB); the embedded model's
#              tokenizer files; llama-cpp-python's Python files (and diskcache, which they import), which
#              load the CUDA libllama through LLAMA_CPP_LIB_PATH
#   build      the top-level CMakeLists.txt with GGML_CUDA=ON into $NBL_GGUF_BUILD (default build-cuda)
#   models     the Llama-3.1-8B-shaped random-weight F16 safetensors folder and its Q4_K_M GGUF
#              (scripts/make_scale_models.py, as in scale-cpu.md)
#   calibrate  `convert` of that GGUF on CUDA, as scale-cpu.md's CPU run (--m 12, 16 x 2048, best,
#              held-out perplexity step): summary, stage times, peak RSS and peak GPU memory; since
#              2026-12-07 it refines the maps (convert's default: the first run of --refine on CUDA)
#   bench8b    llama-bench on CUDA, stock Q4_K_M against the NBL file `calibrate` made: pp512 and tg128
#              at depths 0, 4096 and 16384, 2 interleaved rounds
#   taps       llama-bench on CUDA, Llama-3.2-1B shape (random weights): stock against per-token NBL-6 against
#              taps NBL-6 (K = 4, low-rank lags of rank n_embd/4, as the calibrator's default), pp512 and tg128 at
#              depths 0, 4096 and 16384, 2 interleaved rounds
#   taps8b     the same at the Llama-3.1-8B shape, NBL-12, depths 0 and 4096 (264 s on the H200, files made there)
#   forms1b, forms8b  (not in all) the taps forms side by side at the 1B and 8B shapes: stock, per-token,
#              low-rank lags at rank n_embd/4 (the default) and n_embd/16, per-channel lags (no extra weights),
#              depths 0 and 4096 (8B: 0, the goal's depth; issue 34, item 1); FORMS_8B names the 8B file's forms (default
#              lowrank,lowrank:256,channel): writing the 8B files took over 4.5 min on the H200 machine
#   spill      the calibration on a GPU filled so that one layer fits and the windows' hidden states do not:
#              they spill to host memory, then to disk, with the calibration of the GPU-resident run (pytest)
#   hf         (not in all; not run yet) transformers bf16 on CUDA, same shape and NBL layers, against llama.cpp
#   1b         (not in all; not run yet) Llama-3.2-1B shape, m=6: CPU (-ngl 0 -dev none) and CUDA side by side
#   tests      the in-process and tool tests of the patched llama.cpp (NBL, taps and window layers,
#              llama-server, KV sizes) with every layer offloaded (NBL_GGUF_N_GPU_LAYERS=99; the tools offload by default);
#              tests/test_llama_cuda.py: each file's CUDA logits against the same build's CPU backend; then
#              the PyTorch comparisons again with TF32 off (NVIDIA_TF32_OVERRIDE=0; not run yet)
#   stream     the streamed calibration against the whole model on CUDA (scripts/gpu_tokenizer_plugin.py)
#
# Environment: RESULTS (default $OUT/gpu when the device tool sets OUT, else bench-results/gpu),
# NBL_GGUF_BUILD (default build-cuda), PYTHON (default python3), CUDA_ARCH (default 90: H100/H200),
# BENCH_WORK (large files, default /tmp/nbl-gpu-work), PACK_TO (a .tar.gz the results are packed into after
# each stage: the device tool brings back few files, and a run cut off at its limit keeps what it finished).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export NBL_GGUF_BUILD=${NBL_GGUF_BUILD:-$root/build-cuda}
results=${RESULTS:-${OUT:+$OUT/gpu}}
results=${results:-$root/bench-results/gpu}
work=${BENCH_WORK:-/tmp/nbl-gpu-work}
arch=${CUDA_ARCH:-90}
PYTHON=${PYTHON:-$(command -v python3)}
carry=$root/.carry
scale=$work/scale
stock_gguf=$scale/llama-3.1-8b-random-q4_k_m.gguf
nbl_gguf=$work/nbl-8b-cuda.gguf
mkdir -p "$results" "$work"
export PYTHONPATH="$root:$carry/pylib${PYTHONPATH:+:$PYTHONPATH}"
export LLAMA_CPP_LIB_PATH=$NBL_GGUF_BUILD/bin
# gguf-py from the packed tree where the environment has none (the GPU image has none)
if ! "$PYTHON" -c "import gguf" 2>/dev/null; then
    export PYTHONPATH="$NBL_GGUF_BUILD/llama.cpp-src/gguf-py:$PYTHONPATH"
fi

log() { echo "gpu_bench: $(date +%T) $*" >&2; }
timed() { "$PYTHON" - "$@" <<'EOF'
import resource, subprocess, sys, time
t = time.time(); rc = subprocess.call(sys.argv[1:])
print(f"gpu_bench: wall {time.time() - t:.1f} s, peak RSS of children {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.2f} GiB, rc {rc}", file=sys.stderr)
sys.exit(rc)
EOF
}

stage_pack() {
    local build=$root/build
    [ -f "$build/llama.cpp-src.stamp" ] || { log "no patched tree in $build: run scripts/setup.sh first"; exit 1; }
    mkdir -p "$carry/tokenizer" "$carry/pylib"
    tar -C "$build" --exclude='llama.cpp-src/models' --exclude='llama.cpp-src/docs' --exclude='llama.cpp-src/benches' \
        --exclude='llama.cpp-src/tests' --exclude='llama.cpp-src/.git' --exclude='__pycache__' \
        -cJf "$carry/llama-tree.tar.xz" llama.cpp-src llama.cpp-stock-src llama.cpp-src.stamp
    local model_dir
    model_dir=$("$PYTHON" -c "from nbl_gguf import models; print(models.default_model_dir())")
    cp "$model_dir"/{tokenizer.json,tokenizer_config.json,config.json} "$carry/tokenizer/"
    local package  # looked up without PYTHONPATH, which names the packed copies
    package=$(env -u PYTHONPATH "$PYTHON" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))")
    rm -rf "$carry/pylib/llama_cpp"
    cp -r "$package" "$carry/pylib/llama_cpp"
    rm -rf "$carry/pylib/llama_cpp/lib"
    # llama_cpp imports diskcache (pure Python), which the GPU image does not list
    package=$(env -u PYTHONPATH "$PYTHON" -c "import diskcache, os; print(os.path.dirname(diskcache.__file__))")
    rm -rf "$carry/pylib/diskcache"
    cp -r "$package" "$carry/pylib/diskcache"
    find "$carry/pylib" -name __pycache__ -prune -exec rm -rf {} +
    log "packed $(du -sh "$carry" | cut -f1) into $carry"
}

stage_build() {
    nvidia-smi -L
    if [ ! -f "$NBL_GGUF_BUILD/llama.cpp-src.stamp" ]; then
        mkdir -p "$NBL_GGUF_BUILD"
        tar -C "$NBL_GGUF_BUILD" -xJf "$carry/llama-tree.tar.xz"
    fi
    GGML_CUDA=ON NBL_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch ${NBL_CMAKE_ARGS:-}" PYTHON=$PYTHON \
        bash "$root/scripts/build_llama.sh" > "$results/build.log" 2>&1 || { tail -40 "$results/build.log"; exit 1; }
    "$NBL_GGUF_BUILD/bin/llama-bench" --list-devices
}

stage_models() {
    timed "$PYTHON" scripts/make_scale_models.py --shape llama-3.1-8b --out "$scale" --tokenizer "$carry/tokenizer"
    rm -rf "$scale/llama-3.1-8b-random-f16"  # the disk holds the GGUFs; the folder is not read again
}

stage_calibrate() {
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    timed "$PYTHON" -m nbl_gguf convert --model "$stock_gguf" --m 12 --nsamples 16 --seqlen 2048 --device cuda \
        --save-calibration "$work/calibration-8b-cuda" --no-progress -o "$nbl_gguf" 2>&1 | tee "$results/calibrate-8b.log"
    cp "$work/calibration-8b-cuda/report.json" "$results/calibrate-8b-report.json" 2>/dev/null || true
}

stage_bench8b() {
    "$PYTHON" -m nbl_gguf bench --baseline "$stock_gguf" --nbl "$nbl_gguf" --backends cuda -d 0,4096,16384 \
        -p 512 -n 128 --rounds 2 -r 2 --no-plot -o "$results/bench-8b-cuda" 2>&1 | tail -40
}

stage_taps() {
    "$PYTHON" -m nbl_gguf bench --shape llama-3.2-1b --m 6 --taps 1,4 --quant q4_k_m --backends cuda -d 0,4096,16384 \
        -p 512 -n 128 --rounds 2 -r 2 --no-plot --work-dir "$work/bench" -o "$results/taps-1b-cuda" 2>&1 | tail -40
}

stage_taps8b() {
    "$PYTHON" -m nbl_gguf bench --shape llama-3.1-8b --m 12 --taps 1,4 --quant q4_k_m --backends cuda -d 0,4096 \
        -p 512 -n 128 --rounds 2 -r 2 --no-plot --work-dir "$work/bench" -o "$results/taps-8b-cuda" 2>&1 | tail -40
}

stage_forms1b() {
    "$PYTHON" -m nbl_gguf bench --shape llama-3.2-1b --m 6 --taps 1,4 --taps-forms lowrank,lowrank:128,channel \
        --quant q4_k_m --backends cuda -d 0,4096 -p 512 -n 128 --rounds 2 -r 2 --no-plot --work-dir "$work/bench" \
        -o "$results/taps-forms-1b-cuda" 2>&1 | tail -40
}

stage_forms8b() {
    "$PYTHON" -m nbl_gguf bench --shape llama-3.1-8b --m 12 --taps 1,4 --taps-forms "${FORMS_8B:-lowrank,lowrank:256,channel}" \
        --quant q4_k_m --backends cuda -d 0 -p 512 -n 128 --rounds 2 -r 2 --no-plot --work-dir "$work/bench" \
        -o "$results/taps-forms-8b-cuda" 2>&1 | tail -40
}

stage_spill() {
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    "$PYTHON" -m pytest -q -rA -s -p no:cacheprovider -o addopts="" tests/test_calibrate_stream.py -k real_gpu \
        2>&1 | tee "$results/spill-cuda.log" | tail -30
}

stage_hf() {
    "$PYTHON" -m nbl_gguf bench --shape llama-3.1-8b --m 12 --quant q4_k_m --backends cuda -d 0 -p 512 -n 128 \
        --rounds 2 -r 2 --hf-compare --device cuda --dtype bf16 --work-dir "$work/bench" -o "$results/llama-3.1-8b-hf-compare"
}

stage_1b() {
    "$PYTHON" -m nbl_gguf bench --shape llama-3.2-1b --m 6 --quant q4_k_m --backends cpu,cuda -d 0,2048,8192 \
        -p 512 -n 64 --rounds 2 -r 1 --work-dir "$work/bench" -o "$results/llama-3.2-1b-q4_k_m-cpu-cuda"
}

stage_tests() {
    # in the GPU image, loading libllama in-process died in print_info on std::ostream symbols resolved
    # from libggml-cuda.so; the system libstdc++ first avoids it (docs/results/gpu.md)
    local preload=/lib/x86_64-linux-gnu/libstdc++.so.6
    [ -f "$preload" ] || preload=
    LD_PRELOAD=$preload NBL_GGUF_N_GPU_LAYERS=99 "$PYTHON" -m pytest -q -rA -p no:cacheprovider -o addopts="" \
        tests/test_llama_cuda.py tests/test_llama_nbl.py tests/test_llama_taps.py tests/test_llama_window.py \
        tests/test_llama_server.py tests/test_kv_cache.py \
        2>&1 | tee "$results/tests-cuda.log" | tail -60 || true  # the failures are the log's to report, not a stop
    # the comparisons with PyTorch at 1e-3 again, with cuBLAS's TF32 off (ggml allows it, and it alone put
    # the stock file 3e-3 from the CPU backend): not run yet (docs/results/gpu.md)
    LD_PRELOAD=$preload NBL_GGUF_N_GPU_LAYERS=99 NVIDIA_TF32_OVERRIDE=0 "$PYTHON" -m pytest -q -rA -p no:cacheprovider \
        -o addopts="" tests/test_llama_nbl.py tests/test_llama_taps.py tests/test_llama_window.py tests/test_llama_cuda.py \
        2>&1 | tee "$results/tests-cuda-tf32-off.log" | tail -30 || true
    # the same comparisons on the CPU backend of this build on this machine: with TF32 off the taps and
    # window tests still missed their references on CUDA (5e-3 to 1.5e-2) while test_llama_cuda found CUDA
    # within 3e-6 of this CPU backend (2026-11-27, docs/results/gpu.md); this tells the GPU from the machine
    LD_PRELOAD=$preload NBL_GGUF_N_GPU_LAYERS=0 "$PYTHON" -m pytest -q -rA -p no:cacheprovider -o addopts="" \
        tests/test_llama_taps.py tests/test_llama_window.py -k "match or same_logits" \
        2>&1 | tee "$results/tests-cpu-backend.log" | tail -20 || true
}

stage_stream() {
    # the calibrator on the default device (CUDA here) against its float64 numpy reference, every family
    PYTHONPATH="$root/scripts:$PYTHONPATH" "$PYTHON" -m pytest -q -rA -p no:cacheprovider -o addopts="" \
        -p gpu_tokenizer_plugin tests/test_calibrate_stream.py \
        -k "every_family or auto_and_greedy or hidden_states_on_disk or every_layer_type or budget_below" \
        2>&1 | tee "$results/stream-cuda.log" | tail -30
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(all)
for stage in "${stages[@]}"; do
    case $stage in
        all) for s in build models calibrate bench8b taps taps8b tests stream spill; do log "stage $s"; "stage_$s"; done ;;
        pack|build|models|calibrate|bench8b|taps|taps8b|forms1b|forms8b|spill|hf|1b|tests|stream)
            log "stage $stage"; "stage_$stage"
            log "stage $stage done"
            [ -z "${PACK_TO:-}" ] || tar -C "$(dirname "$results")" -czf "$PACK_TO" "$(basename "$results")" ;;
        *) log "unknown stage '$stage' (pack, build, models, calibrate, bench8b, taps, taps8b, forms1b, forms8b, spill, hf, 1b, tests, stream, all)"
           exit 2 ;;
    esac
done
log "results in $results"
