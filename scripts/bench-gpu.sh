#!/usr/bin/env bash
# The GPU figures of the README in one run (on the GPU machine, from the
# repository root): decode ms/token at depth for every attention kind and the
# committed adapter, still's prefill, stage-1 training throughput, and the
# PyTorch peer on the same shape, written as markdown to OUT.
#
#   scripts/bench-gpu.sh [STILL] [MODEL] [OUT]
#     STILL  the engine with the CUDA backend (default build-cuda/still)
#     MODEL  the default model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
#     OUT    the markdown file (default bench/results/gpu-DATE.md)
# Knobs: DEPTHS (1024,16384,65536), NGEN (128), REPS (5), PREFILL
# (16384,65536), TRAIN_TOKENS (2000000; 0 skips training), DATA (a training
# text, default ../shared/data/corpus/jargon.txt), SKIP_PEER=1 (no PyTorch peer).
set -euo pipefail
STILL=${1:-build-cuda/still}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${3:-bench/results/gpu-$(date -u +%F).md}
ADAPTER=${ADAPTER:-adapters/smollm2-135m-still.gguf}
DEPTHS=${DEPTHS:-1024,16384,65536}
NGEN=${NGEN:-128}
REPS=${REPS:-5}
PREFILL=${PREFILL:-16384,65536}
TRAIN_TOKENS=${TRAIN_TOKENS:-2000000}
DATA=${DATA:-../shared/data/corpus/jargon.txt}
for f in "$STILL" "$MODEL" "$ADAPTER"; do
  [ -e "$f" ] || { echo "bench-gpu: $f not found" >&2; exit 1; }
done
if [ "$TRAIN_TOKENS" != 0 ] && [ ! -f "$DATA" ]; then
  echo "bench-gpu: training text $DATA not found (DATA=..., or TRAIN_TOKENS=0)" >&2
  exit 1
fi
mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp "$OUT.XXXXXX")
trap 'rm -f "$tmp" "$tmp.gguf"' EXIT

table() { grep '^|' || true; }
{
  echo "# GPU benchmark, $(date -u '+%F %T') UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  echo
  echo "## Decode: \`$STILL bench -m MODEL --device cuda -p 0 -n $NGEN -r $REPS --no-warmup -d $DEPTHS\`"
  echo
  "$STILL" bench -m "$MODEL" --device cuda -p 0 -n "$NGEN" -r "$REPS" --no-warmup -d "$DEPTHS" --adapter "$ADAPTER" | table
  "$STILL" bench -m "$MODEL" --device cuda -p 0 -n "$NGEN" -r "$REPS" --no-warmup -d "$DEPTHS" \
    --attn still,lolcats,softmax,swa,liger | table | grep -v '^| model\|^| ---'
  echo
  echo "## Prefill, committed adapter: \`-p $PREFILL -n 0 -r 3\`"
  echo
  "$STILL" bench -m "$MODEL" --device cuda --adapter "$ADAPTER" -p "$PREFILL" -n 0 -r 3 | table
  if [ "$TRAIN_TOKENS" != 0 ]; then
    echo
    echo "## Stage-1 training: \`linearize --device cuda --attn still --per-kv-head --tokens $TRAIN_TOKENS --seq 1024 --batch 8\` on $(basename "$DATA")"
    echo
    echo '```'
    "$STILL" linearize -m "$MODEL" --attn still --per-kv-head --device cuda --data "$DATA" --tokens "$TRAIN_TOKENS" \
      --seq 1024 --batch 8 --val-max 8 --seed 1 --outtype f16 -o "$tmp.gguf" 2>&1 | grep -E '^training:|val-' || true
    echo '```'
  fi
  if [ "${SKIP_PEER:-0}" != 1 ]; then
    echo
    echo "## Peer: \`python3 scripts/bench-gpu-peer.py --lengths $DEPTHS --ngen 32 --reps 3\`"
    echo
    python3 scripts/bench-gpu-peer.py --lengths "$DEPTHS" --ngen 32 --reps 3 || echo "(the peer failed: is PyTorch with transformers installed?)"
  fi
} > "$tmp"
mv "$tmp" "$OUT"
trap - EXIT
rm -f "$tmp.gguf"
echo "bench-gpu: $OUT"
cat "$OUT"
