#!/usr/bin/env bash
# Group crash/timeout/leak reproducers by where they fail: for each file, the sanitizer's or
# GGML_ASSERT's message and the first frames in llama.cpp (src/, ggml/), then one line per group:
# count, example file, signature. Frames in the patches' functions are what docs/fuzzing.md calls
# attributable to the patch.
#
#   fuzz/triage.sh [FILE...]      default: build-fuzz/artifacts/*
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
fuzz_build=${NBL_FUZZ_BUILD:-$root/build-fuzz}
[ $# -gt 0 ] || set -- "$fuzz_build"/artifacts/*
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

for file in "$@"; do
    [ -f "$file" ] || continue
    log=$(timeout 120 "$fuzz_build/fuzz-load-model" -rss_limit_mb=2048 -timeout=30 "$file" 2>&1)
    what=$(grep -m1 -oE "runtime error: [^0-9]*|GGML_ASSERT\(.*\) failed|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer): [a-z-]+( [a-z-]+)?|error: [a-z ]+" <<<"$log")
    where=$(grep -E "^ +#[0-9]+ 0x[0-9a-f]+ in .* (/|\.\./)[^ ]*(src|ggml)/" <<<"$log" | grep -v "ggml_abort\|ggml_print_backtrace" |
            head -3 | sed -E 's/^ +#[0-9]+ 0x[0-9a-f]+ in //; s/\(.*\) (\/|\.\.\/)/ /; s/ [^ ]*\/(src|ggml)\// \1\//' | tr '\n' ';')
    [ -n "$what$where" ] || what="no failure on replay"
    printf '%s\t%s | %s\n' "$file" "$what" "$where"
done | sort -t$'\t' -k2 | awk -F'\t' '{ n[$2]++; if (!($2 in ex)) ex[$2] = $1 } END { for (s in n) printf "%5d  %s\n       %s\n", n[s], ex[s], s }'
