#!/usr/bin/env bash
# The GPU check of issue 28's rules typed once (2026-12-06, second session): the denominator, NP-Map's reflection and
# rescale, the GPU's one sigmoid (the prefill's fast exponential now everywhere), the logit scale, Sel's 8-bit rows,
# the window rule, the plan checks and the selection rules in src/kinds/attn_rules.h and attn_still_rules.h; with
# test_finetune_cuda's new bf16 batch check (issue 25). The tree before (66389d1, this session's start) builds
# beside it from dist/a/old.tar.xz (`git archive 66389d1 src cuda include tests/cuda tests/ref CMakeLists.txt
# scripts Makefile`). One GPU machine, /tmp/w. Calls, back to back (scripts/gpu-dist.sh made dist/a ... dist/LAST):
#   gpu.sh start        (carries dist/a) unpack; build this tree into /tmp/w/build, the tree before into build-old
#   gpu.sh part X       (carries dist/X) for every part but the last
#   gpu.sh test LAST    (carries dist/LAST) join the model; test_cuda_kernels (every group), test_model_cuda (in full)
#   gpu.sh train        test_train_cuda and test_finetune_cuda (with the committed adapter)
#   gpu.sh same         perplexity before and after, every kind on the GPU, prefill (-b 512) and decode (-b 1)
set -uo pipefail
W=/tmp/w R=/tmp/w/res
M=$W/model.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
AD=adapters/smollm2-135m-still.gguf
wait_build() {
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" "$1" 2>/dev/null && break; sleep 3; done
    tail -2 "$1"
}
case $1 in
start)
    mkdir -p $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src $W/src-old && cp -r . $W/src/ 2>/dev/null &&
        rm -rf $W/src/dist && tar -C $W/src-old -xJf $CALLER/dist/a/old.tar.xz
    # the tree before builds only with OLD=1 (device time is short: `same` then compares with the 2026-12-06
    # restructure run's figures of the same plans, bench/results/2026-12-06-restructure-gpu/same.txt)
    (setsid nohup bash -c "cd $W/src && scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build > $W/build.log 2>&1;
        [ \"${OLD:-0}\" = 1 ] && cd $W/src-old && scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build-old > $W/build-old.log 2>&1" \
        > /dev/null 2>&1 &)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
part)
    [ -d $R ] || { echo "gpu.sh: $W is not there (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && ls $W
    ;;
test)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    wait_build $W/build.log
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
    timeout 420 $W/build/build-cuda/test_cuda_kernels > $R/test_cuda_kernels.log 2>&1
    echo "test_cuda_kernels exit $?"; grep -v "^PASS\|^ok" $R/test_cuda_kernels.log | tail -25
    cp $R/test_cuda_kernels.log $OUT/
    for a in "" "$AD"; do
        OMP_NUM_THREADS=8 timeout 90 $W/build/test_model_cuda $M 900 $a 2>&1 | grep -v "^PASS" | sed "s|^|test_model_cuda ${a:-softmax}: |"
    done 2>&1 | tee $R/test_model_cuda.txt
    cp $R/test_model_cuda.txt $OUT/
    ;;
train)
    OMP_NUM_THREADS=8 timeout 200 $W/build/test_train_cuda $M $D/austen/emma.txt > $R/test_train_cuda.log 2>&1
    echo "test_train_cuda exit $?"; grep -v "^PASS" $R/test_train_cuda.log | tail -8
    OMP_NUM_THREADS=8 timeout 360 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD > $R/test_finetune_cuda.log 2>&1
    echo "test_finetune_cuda exit $?"; grep -v "^PASS" $R/test_finetune_cuda.log | tail -12
    grep -c "^PASS" $R/test_finetune_cuda.log
    cp $R/test_train_cuda.log $R/test_finetune_cuda.log $OUT/
    ;;
same)
    V="build"; [ -f $W/build-old.log ] && wait_build $W/build-old.log && V="build-old build"
    F=$D/austen/northangerabbey.txt
    for plan in "--attn softmax" "--adapter $AD" "--attn swa --window 256" "--attn liger --window 64" \
                "--attn lolcats" "--attn still"; do
        for b in 512 1; do
            c=2048; [ $b = 1 ] && c=512
            for v in $V; do
                r=$($W/$v/still-cuda perplexity -m $M -f $F -c $c --chunks 2 -b $b --device cuda $plan 2>&1 | tail -1)
                echo "$v | $plan | -c $c -b $b | $r"
            done
        done
    done 2>&1 | tee $R/same.txt
    for v in $V; do
        $W/$v/still-cuda bench -m $M --adapter $AD --device cuda -p 4096 -n 128 -r 3 2>&1 | grep "| pp\|| tg" |
            sed "s/^/$v: /"
    done 2>&1 | tee $R/bench.txt
    cp $R/same.txt $R/bench.txt $OUT/
    ;;
esac
