#!/usr/bin/env bash
# Build the GGUF reader fuzz target with clang + libFuzzer in a temporary
# directory (independent of the main gcc build), seed it with small valid
# files written by tests/tools/gguf_seed.c, and fuzz for a bounded time.
#
#   FUZZ_SECONDS   fuzzing time (default 30)
#   CLANG          compiler (default: clang)
#   FUZZ_KEEP=1    keep the work directory even on success
#
# Exits non-zero if the build fails or the fuzzer finds a crash, leak,
# timeout or sanitizer report; the work directory (with the crashing input)
# is then kept and its path printed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLANG=${CLANG:-clang}
SECS=${FUZZ_SECONDS:-30}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/still_fuzz.XXXXXX")
keep=${FUZZ_KEEP:-0}
cleanup() {
    if [ "$keep" = 1 ]; then echo "run_fuzz: work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

SRCS=("$ROOT/src/gguf.c" "$ROOT/src/common.c" "$ROOT/src/quant.c")
for s in "${SRCS[@]}"; do
    [ -f "$s" ] || { echo "run_fuzz: missing $s" >&2; exit 1; }
done

CFLAGS=(-std=gnu11 -g -O1 -fno-omit-frame-pointer -D_GNU_SOURCE -march=native
        -I"$ROOT/include" -I"$ROOT/src")
# quant.c may use OpenMP; use it when this clang can link it.
if echo 'int main(void){return 0;}' | "$CLANG" -fopenmp -x c - -o "$WORK/omp_probe" 2>/dev/null; then
    CFLAGS+=(-fopenmp)
fi
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)

echo "run_fuzz: building in $WORK"
"$CLANG" "${CFLAGS[@]}" "${SAN[@]}" -fsanitize=fuzzer \
    "$ROOT/tests/fuzz/fuzz_gguf.c" "${SRCS[@]}" -o "$WORK/fuzz_gguf" -lm
"$CLANG" "${CFLAGS[@]}" "${SAN[@]}" \
    "$ROOT/tests/tools/gguf_seed.c" "${SRCS[@]}" -o "$WORK/gguf_seed" -lm

mkdir -p "$WORK/seeds" "$WORK/corpus"
"$WORK/gguf_seed" "$WORK/seeds"
# a few degenerate seeds too
printf 'GGUF' > "$WORK/seeds/magic_only"
printf 'GGUF\003\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000' \
    > "$WORK/seeds/header_only"

echo "run_fuzz: fuzzing for ${SECS}s"
set +e
(cd "$WORK" && OMP_NUM_THREADS=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
    ./fuzz_gguf -max_total_time="$SECS" -max_len=16384 -timeout=10 -rss_limit_mb=2048 \
        -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$WORK/" \
        corpus seeds > fuzz.log 2>&1)
rc=$?
set -e
tail -n 25 "$WORK/fuzz.log"
if [ $rc -ne 0 ] || ls "$WORK"/crash-* "$WORK"/leak-* "$WORK"/timeout-* "$WORK"/oom-* >/dev/null 2>&1; then
    keep=1
    echo "run_fuzz: FAILED (exit $rc); crashing inputs and fuzz.log are in $WORK" >&2
    exit 1
fi
echo "run_fuzz: OK, no crash in ${SECS}s"
