#!/usr/bin/env bash
# Pack what a GPU session carries beside the tree (the device machine gets the
# repository's tracked and untracked-not-ignored files plus up to 8 `carry`
# paths, 64 MiB a call in all): dist/a = libs.tar.xz (the CPU engine's static
# libraries for scripts/build-cuda-remote.sh) + data.tar.xz (the shared
# corpora) + the model's first part; dist/b, dist/c, ... = the model's other
# parts, each small enough to travel beside the tree. Prints the calls' order.
#
#   scripts/gpu-dist.sh [MODEL] [CORPUS_DIR]
#
# Needs Debian's libopenblas-openmp-dev, libpcre2-dev and libcjson-dev here
# (.ci/run installs them). The parts join with `cat model.part* > model.gguf`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CORPUS=${2:-../shared/data/corpus}
LIMIT=$((64 * 1024 * 1024))
[ -f "$MODEL" ] || { echo "gpu-dist: error: $MODEL missing (make model)" >&2; exit 1; }
[ -d "$CORPUS" ] || { echo "gpu-dist: error: corpus folder $CORPUS missing" >&2; exit 1; }
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r stat -c %s -- 2>/dev/null |
    awk '{s += $1} END {print s + 0}')
room=$((LIMIT - tree - 4 * 1024 * 1024))   # a margin: the device counts the tree a little larger than this sum
[ "$room" -gt $((4 * 1024 * 1024)) ] || { echo "gpu-dist: error: the tree is $tree bytes: no room to carry" >&2; exit 1; }
rm -rf dist && mkdir -p dist/a
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lib" "$tmp/include/cjson"
cp -L /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.a /usr/lib/x86_64-linux-gnu/libpcre2-8.a "$tmp/lib/"
cp /usr/include/x86_64-linux-gnu/openblas-openmp/*.h /usr/include/pcre2.h "$tmp/include/"
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$tmp/lib/" && cp /usr/include/cjson/cJSON.h "$tmp/include/cjson/"
tar -C "$tmp" -cJf dist/a/libs.tar.xz lib include
tar -C "$CORPUS" -cJf dist/a/data.tar.xz .
first=$((room - $(stat -c %s dist/a/libs.tar.xz) - $(stat -c %s dist/a/data.tar.xz)))
[ "$first" -gt 0 ] || { echo "gpu-dist: error: libraries and corpora alone fill the room" >&2; exit 1; }
size=$(stat -c %s "$MODEL")
dd if="$MODEL" of=dist/a/model.part00 bs=1M iflag=count_bytes count="$first" status=none
off=$first i=1
for d in b c d e f g h i j k; do
    [ "$off" -lt "$size" ] || break
    mkdir -p "dist/$d"
    dd if="$MODEL" of="dist/$d/$(printf 'model.part%02d' $i)" bs=1M iflag=skip_bytes,count_bytes skip="$off" \
        count="$room" status=none
    off=$((off + room)) i=$((i + 1))
done
[ "$off" -ge "$size" ] || { echo "gpu-dist: error: the model needs more parts than dist/b..k" >&2; exit 1; }
cat dist/*/model.part* | cmp -s - "$MODEL" || { echo "gpu-dist: error: the parts do not join to the model" >&2; exit 1; }
echo "gpu-dist: tree $tree bytes; carry, one call each, back to back: $(ls dist | sed 's#^#dist/#' | tr '\n' ' ')"
