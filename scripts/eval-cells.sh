#!/usr/bin/env bash
# The `still eval` results table as independent jobs: every (configuration,
# task, length) cell is one single-threaded `still eval` run, so a many-core
# machine runs $JOBS of them at once (used on the 16-core host of the GPU
# machine, whose calls are limited to 10 minutes: the jobs run detached from
# the calling shell, longest first, and survive between calls). A cell whose
# JSON exists is skipped, so a queue can be restarted or split across machines.
#
#   scripts/eval-cells.sh prepare DIR...   unpack model parts, binary, data, adapters into $WORK
#   scripts/eval-cells.sh start SAMPLES    queue the cells and start $JOBS workers
#   scripts/eval-cells.sh wait SECONDS TAR wait up to SECONDS for the queue, then pack results into TAR
#
# $CONFIGS (names, space-separated), $TASKS and $LENGTHS restrict the queue.
#
# Inputs (made on the development machine, see README "Evaluating on another
# machine"): dist/a/{model.part00,data.tar.xz}, dist/b/{model.part01,still.xz,
# adapter-lolcats.gguf}, dist/c/adapter-still.gguf.
# Merge the results with scripts/eval-table.py.
# Locally: WORK=DIR with model.gguf, still, data/ and the adapters linked in.
set -euo pipefail
WORK=${WORK:-/tmp/still-remote}
JOBS=${JOBS:-16}
MODEL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
TASKS=${TASKS:-"niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 passkey qa1 qa2"}
LENGTHS=${LENGTHS:-"8192 4096 2048 1024"}

# name|options, in the order of the table's columns (the last ones are diagnostics)
configs() {
  cat <<CFG
softmax|--attn softmax
still-untrained|--attn still
still|--adapter adapter-still.gguf
lolcats|--adapter adapter-lolcats.gguf
swa896|--attn swa --window 896
still-4k|--adapter adapter-still-4k.gguf
still-m2176|--adapter adapter-still.gguf --budget 2176
still-4k-m2176|--adapter adapter-still-4k.gguf --budget 2176
swa2176|--attn swa --window 2176
CFG
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
  if [ -f still.xz ]; then xz -dc still.xz > still.tmp && chmod +x still.tmp && mv still.tmp still && rm still.xz; fi
  [ -f data.tar.xz ] && [ ! -f data/austen/emma.txt ] && tar -C data -xJf data.tar.xz
  ls -la "$WORK"
  [ -f model.gguf ] && echo "$MODEL_SHA  model.gguf" | sha256sum -c -
  ;;
start)
  samples=$2
  cd "$WORK"
  mkdir -p res
  : > queue.txt
  # longest cells first: by length, then softmax (quadratic) before the rest
  for len in $LENGTHS; do
    configs | while IFS='|' read -r name opts; do
      if [ -n "${CONFIGS:-}" ] && [[ " $CONFIGS " != *" $name "* ]]; then continue; fi
      for task in $TASKS; do
        echo "$name|$opts|$task|$len" >> queue.txt
      done
    done
  done
  cat > job.sh <<JOB
#!/usr/bin/env bash
IFS='|' read -r name opts task len <<< "\$1"
out=res/\$name-\$task-\$len
[ -f \$out.json ] && exit 0
OMP_NUM_THREADS=1 ./still eval \$task -m model.gguf --lengths \$len --samples $samples -t 1 \\
  --haystack data/austen/emma.txt --compare "\$name=\$opts" --json \$out.json -v > \$out.md 2> \$out.log
JOB
  chmod +x job.sh
  rm -f all-done
  setsid nohup bash -c "xargs -d '\n' -P $JOBS -n 1 ./job.sh < queue.txt; touch all-done" > runner.log 2>&1 < /dev/null &
  echo "queued $(wc -l < queue.txt) cells, $JOBS workers"
  ;;
wait)
  secs=$2 tar=$3
  cd "$WORK"
  end=$((SECONDS + secs))
  while [ ! -f all-done ] && [ $SECONDS -lt $end ]; do sleep 5; done
  echo "done: $(ls res/*.json 2>/dev/null | wc -l) of $(wc -l < queue.txt) cells; all-done: $([ -f all-done ] && echo yes || echo no)"
  tar -czf "$tar" res runner.log
  ;;
*)
  echo "usage: $0 prepare DIR... | start SAMPLES | wait SECONDS TAR" >&2
  exit 2
  ;;
esac
