#!/usr/bin/env bash
# Build the CUDA engine on a GPU machine that has nvcc, CMake and gcc but not
# the CPU engine's Debian libraries: LIBS is a tarball of lib/libopenblas.a,
# lib/libpcre2-8.a and their headers under include/ (made on the development
# machine; see below). Produces DEST/still-cuda and DEST/test_model_cuda (as
# `make static-cuda` does here) and the backend's own programs in
# DEST/build-cuda (test_cuda_kernels, bench_attn_cuda, bench_still_cuda).
#
#   scripts/build-cuda-remote.sh LIBS.tar.xz DEST
#
# Making LIBS on Debian 12 (libopenblas-openmp-dev, libpcre2-dev):
#   mkdir -p libs/lib libs/include
#   cp -L /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.a /usr/lib/x86_64-linux-gnu/libpcre2-8.a libs/lib/
#   cp /usr/include/x86_64-linux-gnu/openblas-openmp/*.h /usr/include/pcre2.h libs/include/
#   mkdir -p libs/include/cjson && cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 libs/lib/ &&
#       cp /usr/include/cjson/cJSON.h libs/include/cjson/      (optional, libcjson-dev: JSON inputs)
#   tar -C libs -cJf libs.tar.xz lib include
# Without libcjson.so.1 the engine builds without JSON inputs (STILL_NO_CJSON).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: $0 LIBS.tar.xz DEST" >&2; exit 2; }
LIBS=$1 DEST=$2
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$DEST/libs" "$DEST/obj"
tar -C "$DEST/libs" -xJf "$LIBS"
cmake -S cuda -B "$DEST/build-cuda" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$DEST/build-cuda" -j "$(nproc)" 2>&1 | grep -E "error|warning" || true
[ -f "$DEST/build-cuda/libstill_cuda.a" ] || { echo "build-cuda-remote: the CUDA library did not build" >&2; exit 1; }
JSON="-DSTILL_NO_CJSON" JSON_LIB=""
if [ -f "$DEST/libs/lib/libcjson.so.1" ]; then
    JSON="" JSON_LIB="$DEST/libs/lib/libcjson.so.1 -Wl,-rpath,$DEST/libs/lib"
fi
CFLAGS="-O3 -march=x86-64-v3 -fopenmp -std=gnu11 -Wno-psabi -D_GNU_SOURCE -DSTILL_HAVE_CUDA=1 $JSON
        -Iinclude -Isrc -Icuda -I$DEST/libs/include"
export CFLAGS DEST
{ find src -name '*.c' -not -path 'src/serve/*'; ls tests/cuda/test_model_cuda.c tests/cuda/test_train_cuda.c tests/cuda/test_finetune_cuda.c; } |
    xargs -P "$(nproc)" -I{} sh -c 'gcc $CFLAGS -c {} -o "$DEST/obj/$(echo {} | tr / _).o"'
LINK="$DEST/build-cuda/libstill_cuda.a -L$CUDA_HOME/lib64 -lcudart_static -Wl,-rpath,$CUDA_HOME/lib64
      $DEST/libs/lib/libopenblas.a $DEST/libs/lib/libpcre2-8.a $JSON_LIB -lstdc++ -lm -ldl -lrt -lpthread"
engine=$(ls "$DEST"/obj/src_*.o)
gcc -fopenmp -o "$DEST/still-cuda" $engine $LINK
for t in test_model_cuda test_train_cuda test_finetune_cuda; do
    gcc -fopenmp -o "$DEST/$t" $(ls "$DEST"/obj/src_*.o | grep -v src_cli_) "$DEST/obj/tests_cuda_$t.c.o" $LINK
done
echo "build-cuda-remote: $DEST/still-cuda $DEST/test_model_cuda $DEST/test_train_cuda $DEST/test_finetune_cuda"
