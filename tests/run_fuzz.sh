#!/usr/bin/env bash
# Build a fuzz target with clang + libFuzzer in a temporary directory
# (independent of the main gcc build), seed it, and fuzz for a bounded time.
#
#   tests/run_fuzz.sh [gguf|adapter]
#
#   gguf      the GGUF reader (tests/fuzz/fuzz_gguf.c), seeded with small
#             valid files from tests/tools/gguf_seed.c (the default)
#   adapter   adapter files applied to a tiny model (tests/fuzz/fuzz_adapter.c:
#             the whole engine but the command line, instrumented), seeded with
#             valid adapters of every kind from tests/tools/adapter_seed.c
#
#   FUZZ_SECONDS   fuzzing time (default 30)
#   CLANG          compiler (default: clang-16, else clang; the adapter target
#                  needs one with _Float16 on x86: clang 15 or later)
#   FUZZ_KEEP=1    keep the work directory even on success
#
# Exits non-zero if the build fails or the fuzzer finds a crash, leak,
# timeout or sanitizer report; the work directory (with the crashing input)
# is then kept and its path printed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${1:-gguf}
CLANG=${CLANG:-$(command -v clang-16 || command -v clang || echo clang)}
SECS=${FUZZ_SECONDS:-30}
command -v "$CLANG" >/dev/null || { echo "run_fuzz: $CLANG not found (apt-get install clang-16 libclang-rt-16-dev libomp-16-dev)" >&2; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/still_fuzz.XXXXXX")
keep=${FUZZ_KEEP:-0}
cleanup() {
    if [ "$keep" = 1 ]; then echo "run_fuzz: work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

CFLAGS=(-std=gnu11 -g -O1 -fno-omit-frame-pointer -D_GNU_SOURCE -march=native
        -I"$ROOT/include" -I"$ROOT/src")
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
case $TARGET in
gguf)
    SRCS=("$ROOT/src/format/gguf.c" "$ROOT/src/common/common.c" "$ROOT/src/format/quant.c")
    LIBS=(-lm)
    # quant.c may use OpenMP; use it when this clang can link it.
    if echo 'int main(void){return 0;}' | "$CLANG" -fopenmp -x c - -o "$WORK/omp_probe" 2>/dev/null; then
        CFLAGS+=(-fopenmp)
    fi
    SEED_TOOL=gguf_seed MAXLEN=16384
    ;;
adapter)
    mapfile -t SRCS < <(find "$ROOT/src" -name "*.c" -not -path "*/src/cli/*" -not -path "*/src/serve/*" | sort)
    BLAS_INC=/usr/include/x86_64-linux-gnu/openblas-openmp BLAS_LIB=/usr/lib/x86_64-linux-gnu/openblas-openmp
    CFLAGS+=(-fopenmp -I"$BLAS_INC")
    LIBS=(-L"$BLAS_LIB" -lopenblas -lpcre2-8 -lcjson -lm)
    SEED_TOOL=adapter_seed MAXLEN=131072
    ;;
*) echo "usage: $0 [gguf|adapter]" >&2; exit 2 ;;
esac
for s in "${SRCS[@]}"; do
    [ -f "$s" ] || { echo "run_fuzz: missing $s" >&2; exit 1; }
done

echo "run_fuzz: building fuzz_$TARGET with $CLANG in $WORK"
"$CLANG" "${CFLAGS[@]}" "${SAN[@]}" -fsanitize=fuzzer \
    "$ROOT/tests/fuzz/fuzz_$TARGET.c" "${SRCS[@]}" -o "$WORK/fuzz_$TARGET" "${LIBS[@]}" 2> "$WORK/build.log" ||
    { keep=1; grep -m 20 "error" "$WORK/build.log" >&2; echo "run_fuzz: FAILED to build fuzz_$TARGET" >&2; exit 1; }
"$CLANG" "${CFLAGS[@]}" "${SAN[@]}" \
    "$ROOT/tests/tools/$SEED_TOOL.c" "${SRCS[@]}" -o "$WORK/$SEED_TOOL" "${LIBS[@]}" 2>> "$WORK/build.log" ||
    { keep=1; grep -m 20 "error" "$WORK/build.log" >&2; echo "run_fuzz: FAILED to build $SEED_TOOL" >&2; exit 1; }

mkdir -p "$WORK/seeds" "$WORK/corpus"
"$WORK/$SEED_TOOL" "$WORK/seeds"
rm -f "$WORK/seeds/model.gguf"   # adapter_seed's tiny model: not an adapter
# a few degenerate seeds too
printf 'GGUF' > "$WORK/seeds/magic_only"
printf 'GGUF\003\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000\000' \
    > "$WORK/seeds/header_only"
n_seeds=$(ls "$WORK/seeds" | wc -l)

echo "run_fuzz: fuzzing for ${SECS}s from $n_seeds seeds"
set +e
(cd "$WORK" && OMP_NUM_THREADS=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
    ./fuzz_$TARGET -max_total_time="$SECS" -max_len=$MAXLEN -timeout=10 -rss_limit_mb=2048 \
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
