#!/usr/bin/env bash
# Stage-1 training of the still and lolcats adapters on a larger CPU machine
# (used on the 16-core host of the GPU machine, whose calls are limited to
# 10 minutes: the runs checkpoint and resume across calls).
#
#   scripts/linearize-remote.sh prepare DIR...   unpack model parts, binary, data into $WORK
#   scripts/linearize-remote.sh probe            measure tokens/s of both kinds (8 threads each)
#   scripts/linearize-remote.sh train SECONDS TOKENS_STILL TOKENS_LOLCATS
#                                                start or resume both runs, stop after SECONDS
#
# The inputs are made on the development machine by:
#   gcc ... -static -o dist/still (see README, "Training on another machine")
#   split the model into dist/a/model.part00 and dist/b/model.part01,
#   dist/a/data.tar.xz (the training text), dist/b/still.xz
set -euo pipefail
WORK=${WORK:-/tmp/still-remote}
MODEL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
THREADS=${THREADS:-8}

data_args() {
  local d=$WORK/data
  echo --data $d/python-docs.txt --data $d/jargon.txt --data $d/austen/emma.txt --data $d/austen/mansfieldpark.txt \
    --data $d/austen/prideandprejudice.txt --data $d/austen/senseandsensibility.txt
}

case "${1:-}" in
prepare)
  shift
  mkdir -p "$WORK/data"
  for d in "$@"; do cp -f "$d"/* "$WORK"/; done
  cd "$WORK"
  if [ -f model.part00 ] && [ -f model.part01 ] && [ ! -f model.gguf ]; then
    cat model.part00 model.part01 > model.gguf.tmp && mv model.gguf.tmp model.gguf
  fi
  [ -f still.xz ] && [ ! -x still ] && xz -dc still.xz > still && chmod +x still
  [ -f data.tar.xz ] && [ ! -f data/jargon.txt ] && tar -C data -xJf data.tar.xz
  ls -la "$WORK" "$WORK/data"
  [ -f model.gguf ] && echo "$MODEL_SHA  model.gguf" | sha256sum -c -
  ;;
probe)
  cd "$WORK"
  for kind in still lolcats; do
    ./still linearize -m model.gguf --attn $kind $(data_args) --tokens 16384 --batch 2 --val-max 1 -t "$THREADS" \
      -o probe-$kind.gguf > probe-$kind.md 2> probe-$kind.log &
  done
  wait
  grep -h "^training:" probe-*.md
  ;;
train)
  secs=$2 tok_still=$3 tok_lol=$4
  cd "$WORK"
  for kind in still lolcats; do
    tok=$tok_still
    [ $kind = lolcats ] && tok=$tok_lol
    [ -f adapter-$kind.gguf ] && continue
    resume=
    [ -f adapter-$kind.gguf.ckpt ] && resume=--resume
    timeout -s KILL "$secs" ./still linearize -m model.gguf --attn $kind $(data_args) --tokens "$tok" --seq 1024 \
      --batch 8 --val-max 16 --seed 1 --ckpt-every 4 -t "$THREADS" $resume -o adapter-$kind.gguf \
      >> train-$kind.md 2>> train-$kind.log &
  done
  wait || true
  tail -n 3 train-*.log
  ls -la
  ;;
*)
  echo "usage: $0 prepare DIR... | probe | train SECONDS TOKENS_STILL TOKENS_LOLCATS" >&2
  exit 2
  ;;
esac
