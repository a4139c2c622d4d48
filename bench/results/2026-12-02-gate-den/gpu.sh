#!/usr/bin/env bash
# The GPU run of 2026-12-02 for --gate-den (docs/gate-den.md), on one H200;
# /tmp/w as in scripts/build-cuda-remote.sh (the three calls that carry
# dist/a, dist/b, dist/c; this is the third one's command):
#   gpu.sh start     assemble the model, unpack the corpora, then in the
#                    background: phase1 (below)
#   gpu.sh phase1    the CUDA tests (kernels, GPU trainer against the CPU one);
#                    stage 1 continued from step 3's parameters at 8,192
#                    tokens with and without --gate-den (same data, seed,
#                    schedule); each converted to the committed plan's budgets;
#                    validation MSE, held-out perplexity at 2K / 4K / 8K and
#                    the development set at 8K (own templates in Emma)
#   gpu.sh heldout NAME...   the six built-in needle tasks at 1K / 2K / 4K / 8K on
#                    Northanger Abbey, 50 samples a cell, for the configurations named
set -uo pipefail
W=/tmp/w R=/tmp/w/res AD=/tmp/w/ad
S=$W/build/still-cuda M=$W/model.gguf A0=adapters/smollm2-135m-still.gguf
CFG=$R/configs.txt
NL9=6,8,14-15,19-22,24
LB4="--selection global --budget 1406 --layer-budgets 7=8320,17=8320,18=8320,23=8320"
D=$W/data
DATA="--data $D/python-docs.txt --data $D/jargon.txt --data $D/austen/emma.txt --data $D/austen/mansfieldpark.txt
      --data $D/austen/prideandprejudice.txt --data $D/austen/senseandsensibility.txt"
CALLER=$PWD   # (the device call's directory, where dist/c arrives; the copy of the tree has no dist/)
cd "$(dirname "$0")/../../.."

configs() {
    cat > $CFG <<EOF
default|--adapter $W/src/$A0
gd-lb4|--adapter $AD/gd-lb4.gguf
gd-nl9|--adapter $AD/gd-lb4.gguf --no-linear-layers $NL9
gd2-lb4|--adapter $AD/gd2-lb4.gguf
ctl-lb4|--adapter $AD/ctl-lb4.gguf
ctl-nl9|--adapter $AD/ctl-lb4.gguf --no-linear-layers $NL9
EOF
}

case $1 in
start)
    cp $CALLER/dist/c/model.part02 $W/ && (cd $W && cat model.part00 model.part01 model.part02 > model.gguf) &&
        mkdir -p $D $R $AD && tar -C $D -xJf $W/data.tar.xz
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -2 $W/build.log
    (setsid nohup bash "$0" phase1 > $R/phase1.log 2>&1 &)
    ;;
phase1)
    configs
    echo "tests $(date +%T)"   # (beside the training, which does not wait for them)
    ($W/build/build-cuda/test_cuda_kernels --only still > $R/test_cuda_kernels.log 2>&1; echo "test_cuda_kernels rc=$?" >> $R/tests.rc
     $W/build/test_train_cuda > $R/test_train_cuda.log 2>&1; echo "test_train_cuda rc=$?" >> $R/tests.rc) &
    echo "train $(date +%T)"
    # step 3's plan (chunk selection, m = 896 per KV head, the linear branch everywhere), continued at 8K
    train() {   # NAME TOKENS [options]
        local n=$1 t=$2; shift 2
        $S linearize -m $M --adapter $A0 --selection chunk --budget 896 --no-linear-layers '' "$@" --device cuda \
            $DATA --tokens $t --seq 8192 --batch 1 --lr 3e-3 --val-max 4 --seed 4 --ckpt-every 200 \
            --outtype f16 -o $AD/$n.gguf > $R/train-$n.log 2>&1
        echo "train $n rc=$? $(date +%T)"
        $S convert -m $M --adapter $AD/$n.gguf $LB4 --outtype f16 -o $AD/$n-lb4.gguf 2>&1 | tail -1
    }
    train gd 4194304 --gate-den & p1=$!
    train gd2 8388608 --gate-den & p2=$!
    train ctl 4194304 & p3=$!
    wait $p1 $p2 $p3
    grep -h "validation" $R/train-*.log | tail -n 12
    echo "eval $(date +%T)"
    for c in gd-lb4 gd-nl9 gd2-lb4 ctl-lb4 ctl-nl9 default; do
        o=$(grep "^$c|" $CFG | cut -d'|' -f2)
        (for L in 2048 4096 8192; do
            eval "$S perplexity -m $M $o --device cuda -c $L --chunks $((32768 / L)) -f $D/austen/northangerabbey.txt" 2>&1 |
                tail -1 | sed "s#^#$c $L: #"; done > $R/ppl-$c.txt 2>&1) &
        for t in locker price; do
            grep "\"dev_$t\"" bench/data/retrieval-dev.jsonl > $W/dev-$t.jsonl
            TASKFILE=$W/dev-$t.jsonl LENGTHS=8k scripts/eval-retrieval-gpu.sh $S $M $A0 $D/austen/emma.txt \
                $R/dev8k-$t 50 $c $CFG > $R/dev8k-$t-$c.out 2>&1 &
        done
    done
    wait
    echo "phase1 done $(date +%T)"
    touch $R/phase1.done
    ;;
heldout)
    shift
    for c in "$@"; do for L in 1k 2k 4k 8k; do i=0
        for T in niah_single_1,niah_multikey_1,passkey niah_single_2,niah_single_3,niah_multivalue; do i=$((i+1))
            TASKS=$T LENGTHS=$L setsid nohup scripts/eval-retrieval-gpu.sh $S $M $A0 $D/austen/northangerabbey.txt \
                $R/test$i 50 $c $CFG > $R/test-$c-$L-$i.out 2>&1 &
        done; done; done
    ;;
esac
