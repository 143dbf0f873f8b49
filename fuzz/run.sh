#!/usr/bin/env bash
# Fuzz the patched loader (build it first: fuzz/build.sh).
#
#   fuzz/run.sh [SECONDS] [libFuzzer options...]      default: 600 s
#
# Seeds (fuzz/make_seeds.py) and fuzz/regressions/ start the corpus; the corpus grows in
# build-fuzz/corpus. The fuzzing runs in a child process (-fork=1) that is restarted after a crash,
# a hang (over 30 s), a leak or running out of memory (2 GB), so that upstream aborts (GGML_ASSERTs
# on malformed hyper-parameters or vocabularies, docs/fuzzing.md) do not end the run; each leaves its
# reproducer in build-fuzz/artifacts/, and fuzz/triage.sh groups them by where they fail (replay
# one: build-fuzz/fuzz-load-model FILE; FUZZ_NBL_VERBOSE=1 shows llama.cpp's log).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
fuzz_build=${NBL_FUZZ_BUILD:-$root/build-fuzz}
python=${PYTHON:-$root/.venv/bin/python}
seconds=${1:-600}
shift || true

fuzzer="$fuzz_build/fuzz-load-model"
[ -x "$fuzzer" ] || { echo "nbl: no $fuzzer: run fuzz/build.sh first" >&2; exit 1; }

mkdir -p "$fuzz_build/seeds" "$fuzz_build/corpus" "$fuzz_build/artifacts"
PYTHONPATH="$root" "$python" "$root/fuzz/make_seeds.py" "$fuzz_build/seeds" >/dev/null

# leaks are checked after every input that frees less than it allocates; a UB report is a crash
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
exec "$fuzzer" -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -max_len=131072 \
    -print_final_stats=1 -artifact_prefix="$fuzz_build/artifacts/" "$@" \
    "$fuzz_build/corpus" "$fuzz_build/seeds" "$root/fuzz/regressions"
