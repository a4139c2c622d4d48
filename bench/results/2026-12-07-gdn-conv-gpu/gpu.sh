#!/usr/bin/env bash
# gdn's stage 1 on the GPU with the short convolution (issue 29), then the converted 3 : 1 plan's perplexity and
# needle retrieval. One GPU machine, /tmp/w. Calls, back to back (scripts/gpu-dist.sh made dist/a .. dist/e):
#   ../2026-12-07-gdn-gpu/gpu.sh start (dist/a), part b, part c       unpack, build in the background
#   gpu.sh test d e     join the model; test_cuda_kernels --only gdn (the refactored kernels, the conv and no-norm
#                       cases), test_train_cuda (gdn_grad_check with the convolution: stc_gdn_distill against the CPU
#                       kind's step; the trainer comparisons incl. the 3 : 1 conv plan)
#   gpu.sh test2        stage 2 on the GPU for gdn (test_finetune_cuda, STILL_TEST_GDN_ONLY=1), test_model_cuda
#   gpu.sh convert TOKENS SEQ BATCH NAME   stage 1 on the GPU, the plan P below (../2026-12-07-gdn-norm-cpu/'s best:
#                       CPU 512K tokens gave 51.87 / 47.58 at 512 / 2048); the adapter in f16 comes back in $OUT;
#                       Northanger Abbey's perplexity at 512 and 2048 (8 and 4 chunks, as on the CPU)
#   gpu.sh ppl NAME     perplexity at 2K / 4K / 8K (32,768 tokens each) of the original and the adapter NAME
#   gpu.sh eval NAME SAMPLES [CONFIGS]   the six needle tasks at 1K-8K, SAMPLES a cell, greedy, seed 0, Northanger
#                       Abbey as the haystack (scripts/eval-retrieval-gpu.sh's protocol); each (config, task, length)
#                       its own process, 16 at a time on the one GPU; CONFIGS e.g. "NAME softmax" 
set -uo pipefail
W=/tmp/w R=/tmp/w/res4
M=$W/model.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data/austen
B=$W/build
P="gdn/conv=4:0-29,gdn/conv=4/norm=1:8-29,softmax:3,7,11,15,19,23,27"
mkdir -p $R
wait_build() {
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" "$1" 2>/dev/null && break; sleep 3; done
    tail -2 "$1"
}
case $1 in
test)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    for x in "${@:2}"; do cp $CALLER/dist/$x/model.part* $W/; done
    (cd $W && cat model.part* > model.gguf) && sha256sum $M
    wait_build $W/build.log
    grep -i "error" $W/build.log | head -20
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
    timeout 60 $B/build-cuda/test_cuda_kernels --only gdn > $R/test_gdn.log 2>&1
    echo "test_cuda_kernels --only gdn exit $?"; grep -v "^PASS\|^ok" $R/test_gdn.log | tail -8
    OMP_NUM_THREADS=16 timeout 330 $B/test_train_cuda $M $D/emma.txt > $R/test_train_cuda.log 2>&1
    echo "test_train_cuda exit $?"; grep -v "^PASS" $R/test_train_cuda.log | tail -12; grep "gdn" $R/test_train_cuda.log
    cp $R/device.txt $R/test_gdn.log $R/test_train_cuda.log $OUT/
    ;;
test2)   # stage 2: test_finetune_cuda's gdn plans alone (STILL_TEST_GDN_ONLY=1); test_model_cuda
    OMP_NUM_THREADS=16 STILL_TEST_GDN_ONLY=1 timeout 300 $B/test_finetune_cuda $M $D/emma.txt > $R/test_finetune_cuda.log 2>&1
    echo "test_finetune_cuda exit $?"; grep -v "^PASS" $R/test_finetune_cuda.log | tail -12; grep -c "^PASS" $R/test_finetune_cuda.log
    OMP_NUM_THREADS=16 timeout 120 $B/test_model_cuda $M 900 2>&1 | grep -v "^PASS" | tee $R/test_model_cuda.txt
    cp $R/test_finetune_cuda.log $R/test_model_cuda.txt $OUT/
    ;;
convert)
    tok=$2 seq=$3 bat=$4 name=$5
    OMP_NUM_THREADS=16 /usr/bin/time -v $B/still-cuda linearize -m $M --plan "$P" --data $D/emma.txt \
        --data $D/mansfieldpark.txt --data $D/prideandprejudice.txt --tokens $tok --seq $seq --batch $bat --lr 1e-2 \
        --device cuda -o $R/$name.gguf > $R/linearize-$name.txt 2>&1
    echo "linearize $name exit $?"; grep -E "training:|tok/s|wall clock|Maximum resident" $R/linearize-$name.txt | tail -5
    $B/still-cuda convert -m $M --adapter $R/$name.gguf --outtype f16 -o $R/$name-f16.gguf 2>&1 | tail -1
    for c in 512 2048; do
        n=8; [ $c = 2048 ] && n=4
        echo "$name | -c $c | $($B/still-cuda perplexity -m $M --adapter $R/$name-f16.gguf -f $D/northangerabbey.txt -c $c --chunks $n --device cuda 2>&1 | tail -1)"
    done 2>&1 | tee $R/convert-$name.txt
    cp $R/convert-$name.txt $R/linearize-$name.txt $R/$name-f16.gguf $OUT/
    ;;
ppl)
    for c in 2048 4096 8192; do
        for a in "--attn softmax" "--adapter $R/$2-f16.gguf"; do
            echo "$a | -c $c | $($B/still-cuda perplexity -m $M $a -f $D/northangerabbey.txt -c $c --chunks $((32768 / c)) --device cuda 2>&1 | tail -1)"
        done
    done 2>&1 | tee $R/ppl-$2.txt
    cp $R/ppl-$2.txt $OUT/
    ;;
eval)   # gpu.sh eval NAME SAMPLES [CONFIGS]: CONFIGS from "NAME softmax" (default NAME alone)
    name=$2 n=$3 E=$R/eval-$name
    mkdir -p $E
    one() {   # one (configuration, task, length) cell, its own process
        local c=$1 t=$2 L=$3 o
        [ "$c" = softmax ] && o="--attn softmax" || o="--adapter $R/$c-f16.gguf"
        OMP_NUM_THREADS=1 timeout 560 $B/still-cuda eval $t -m $M --device cuda -b 4096 --lengths $L --samples $n \
            --haystack $D/northangerabbey.txt --compare "$c=$o" --json $E/$c-$t-$L.json.tmp > /dev/null 2> $E/$c-$t-$L.log &&
            mv $E/$c-$t-$L.json.tmp $E/$c-$t-$L.json
    }
    t0=$(date +%s)
    for L in 8k 4k 2k 1k; do
        for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multivalue passkey; do
            for c in ${4:-$name}; do
                [ -f $E/$c-$t-$L.json ] && continue
                while [ "$(jobs -rp | wc -l)" -ge 16 ]; do wait -n; done
                one $c $t $L &
            done
        done
    done
    wait
    echo "eval: $(( $(date +%s) - t0 )) s, $(ls $E/*.json | wc -l) cells"
    python3 scripts/eval-table.py $E/*.json | tee $R/eval-$name.md
    cp $R/eval-$name.md $OUT/ && mkdir -p $OUT/eval && cp $E/*.json $E/*.log $OUT/eval/
    ;;
esac
