#!/usr/bin/env bash
# The GPU run of 2026-12-03 for the 8-bit selected store on the GPU (issue 26):
# one H200, /tmp/w as in scripts/build-cuda-remote.sh. Calls, back to back:
#   gpu.sh start     (carries dist/a: libs, corpora, model part 0) unpack, build in the background
#   gpu.sh part      (carries dist/b: model part 1)
#   gpu.sh tests     (carries dist/c: model part 2) join the model, wait for the build, the CUDA
#                    tests of the still kernels (test_cuda_kernels --only still, q8 cases included)
#                    and whole-model logits against the CPU with Sel in 8 bits on both sides
#                    (test_model_cuda, chunk and global selection); then wave 1 in the background
#   gpu.sh wave1     the development set (own templates in Emma, 50 prompts each of dev_locker and
#                    dev_price) at 8K for every configuration of configs.txt but q8-same; the six
#                    built-in needle tasks on the held-out Northanger Abbey at 8K for the q8 layouts
#   gpu.sh wave2 NAME   the held-out tasks at 1K / 2K / 4K for NAME, its perplexity at 2K / 4K / 8K,
#                    decode at depth
#   gpu.sh collect   results into $OUT
set -uo pipefail
W=/tmp/w R=/tmp/w/res
S=$W/build/still-cuda M=$W/model.gguf A=$W/ad/step7.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
export OMP_NUM_THREADS=2
L4="7=8320,17=8320,18=8320,23=8320"
L8="7=8320,14=8320,15=8320,17=8320,18=8320,20=8320,21=8320,23=8320"
L12="7=8320,8=8320,14=8320,15=8320,17=8320,18=8320,19=8320,20=8320,21=8320,22=8320,23=8320,24=8320"

configs() {   # budgets: the largest that keep the CPU's count of the state <= 65.08 MiB (m = 896 per query head, f16)
    cat > $R/configs.txt <<EOC
softmax|--attn softmax
step7|--adapter $A
q8-same|--adapter $A --sel-cache q8
q8-lb4|--adapter $A --sel-cache q8 --budget 3461 --layer-budgets $L4
q8-lb8|--adapter $A --sel-cache q8 --budget 2576 --layer-budgets $L8
q8-lb12|--adapter $A --sel-cache q8 --budget 1306 --layer-budgets $L12
EOC
}
opts() { grep "^$1|" $R/configs.txt | cut -d'|' -f2; }
ev() {   # NAME LENGTH TASKS HAYSTACK OUTDIR TAG [TASKFILE]
    local c=$1 L=$2 T=$3 H=$4 o=$5 tag=$6 tf=${7:-}
    mkdir -p $o
    if [ -n "$tf" ]; then
        TASKFILE=$tf LENGTHS=$L setsid nohup $W/src/scripts/eval-retrieval-gpu.sh $S $M $A $H $o 50 $c $R/configs.txt > $R/$tag.out 2>&1 &
    else
        TASKS=$T LENGTHS=$L setsid nohup $W/src/scripts/eval-retrieval-gpu.sh $S $M $A $H $o 50 $c $R/configs.txt > $R/$tag.out 2>&1 &
    fi
}
H1=niah_single_1,niah_multikey_1,passkey H2=niah_single_2,niah_single_3,niah_multivalue

case $1 in
start)
    mkdir -p $W/ad $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null
    (cd $W/src && setsid nohup scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build > $W/build.log 2>&1 &)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    ;;
part)
    cp $CALLER/dist/b/model.part01 $W/ && ls -la $W
    ;;
tests)
    cp $CALLER/dist/c/model.part02 $W/ && (cd $W && cat model.part00 model.part01 model.part02 > model.gguf) &&
        sha256sum $M && cp adapters/smollm2-135m-still.gguf $A
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    configs
    $W/build/build-cuda/test_cuda_kernels --only still > $R/test_cuda_kernels.log 2>&1; echo "test_cuda_kernels rc=$?"
    grep -E "FAIL|passed" $R/test_cuda_kernels.log | tail -15
    # global selection with evictions (budget 384 < the prompt) and layers of other capacities; chunk selection
    STILL_TEST_SEL=q8 STILL_TEST_SELECTION=global STILL_TEST_BUDGET=384 STILL_TEST_LAYER_BUDGETS=7=8320,17=1024,20-21=256 \
        $W/build/test_model_cuda $M 900 $A > $R/tmc-q8-global.txt 2>&1 &
    STILL_TEST_SEL=q8 STILL_TEST_SELECTION=chunk STILL_TEST_BUDGET=896 STILL_TEST_LAYER_BUDGETS=7=2048 \
        $W/build/test_model_cuda $M 900 $A > $R/tmc-q8-chunk.txt 2>&1 &
    wait
    for sel in global chunk; do echo "test_model_cuda q8 $sel:"; grep -E "still" $R/tmc-q8-$sel.txt | grep -E "FAIL|ratio|arg-max" | head -6; tail -1 $R/tmc-q8-$sel.txt; done
    ;;
wave1)
    for c in softmax step7 q8-lb4 q8-lb8 q8-lb12; do for t in locker price; do
        grep "\"dev_$t\"" $W/src/bench/data/retrieval-dev.jsonl > $W/dev-$t.jsonl
        ev $c 8k - $D/austen/emma.txt $R/dev8k-$t dev-$c-$t $W/dev-$t.jsonl
    done; done
    for c in q8-lb4 q8-lb8 q8-lb12; do
        ev $c 8k $H1 $D/austen/northangerabbey.txt $R/test1 test-$c-8k-1
        ev $c 8k $H2 $D/austen/northangerabbey.txt $R/test2 test-$c-8k-2
    done
    sleep 2; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    ;;
wave2)
    c=$2
    for L in 1k 2k 4k; do
        ev $c $L $H1 $D/austen/northangerabbey.txt $R/test1 test-$c-$L-1
        ev $c $L $H2 $D/austen/northangerabbey.txt $R/test2 test-$c-$L-2
    done
    (for L in 2048 4096 8192; do
        eval "$S perplexity -m $M $(opts $c) --device cuda -c $L --chunks $((32768 / L)) -f $D/austen/northangerabbey.txt" 2>&1 |
            tail -1 | sed "s#^#$c $L: #"; done > $R/ppl-$c.txt 2>&1
     eval "$S bench -m $M $(opts $c) --device cuda -p 512 -n 128 -d 0,8192,32768" > $R/bench-$c.txt 2>&1
     eval "$S bench -m $M --adapter $A --device cuda -p 512 -n 128 -d 0,8192,32768" > $R/bench-step7.txt 2>&1) &
    ;;
collect)
    ls $R/dev8k-*/ $R/test*/ 2>/dev/null | grep -c json
    tail -n 3 $R/*.out 2>/dev/null | grep -v "^$" | tail -40
    tar -C $R -czf $OUT/res.tgz .
    ;;
esac
