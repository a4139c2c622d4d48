#!/usr/bin/env bash
# The GPU runs of 2026-12-05 (afternoon) for issue 25: the still and lolcats layers of the GPU fine-tune run a
# step's sequences in one pass per head (strided-batched products, row kernels over every sequence) instead of one
# sequence at a time; --train-attn's gradients summed in a fixed order. One H200, /tmp/w. Calls, back to back:
#   gpu.sh start         (carries dist/a) unpack; build this tree into /tmp/w/build and, when old-src/ is there
#                        (the three files before the change, not committed), the tree before into /tmp/w/build-old
#   gpu.sh part b        (carries dist/b), and so on for every part but the last
#   gpu.sh test LAST     (carries dist/LAST) join the model; test_finetune_cuda MODEL emma.txt ADAPTER
#   gpu.sh test1 LAST    (a later machine, after the routing became once per step) the still and lolcats cases of
#                        test_finetune_cuda (STILL_TEST_STILL_ONLY=1), then the still adapter at 1024 x 8 twice
#   gpu.sh speed         the committed still adapter's fine-tune at 1024 x 8 and 8192 x 1, before and after the
#                        change, alternated in one run; the softmax plan at 1024 x 8 beside them
set -uo pipefail
W=/tmp/w R=/tmp/w/res
S=$W/build/still-cuda M=$W/model.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
AD=adapters/smollm2-135m-still.gguf
case $1 in
start)
    mkdir -p $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null
    if [ -d old-src ]; then
        mkdir -p $W/src-old && cp -r . $W/src-old/ && cp old-src/train_lm_cuda.c $W/src-old/src/ &&
            cp old-src/train_lm_still.cu old-src/still_cuda.h $W/src-old/cuda/
    fi
    (setsid nohup bash -c "cd $W/src && scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build > $W/build.log 2>&1;
        [ -d $W/src-old ] && cd $W/src-old && scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build-old \
        > $W/build-old.log 2>&1" > /dev/null 2>&1 &)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    ;;
part)
    [ -d $W/res ] || { echo "gpu.sh: $W is not there (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && ls $W
    ;;
test)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    OMP_NUM_THREADS=8 timeout 540 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 |
        tee $R/test_finetune_cuda.log | grep -v "^PASS" | tail -30
    grep -c "^PASS" $R/test_finetune_cuda.log; cp $R/test_finetune_cuda.log $OUT/
    ;;
test1)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -1 $W/build.log
    STILL_TEST_STILL_ONLY=1 OMP_NUM_THREADS=8 timeout 300 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 |
        tee $R/test_finetune_cuda-still.log | grep -v "^PASS" | tail -20
    cp $R/test_finetune_cuda-still.log $OUT/
    for r in 1 2; do
        $S finetune -m $M --adapter $AD --data $D/austen/emma.txt --device cuda --tokens 393216 --seq 1024 --batch 8 \
            --val-max 2 -s 1 -o $R/sp1.gguf 2>&1 | grep "training:\|after\|error" | sed "s/^/still 1024x8 run $r: /"
    done 2>&1 | tee $R/speed1.txt; cp $R/speed1.txt $OUT/
    ;;
speed)
    for i in $(seq 1 100); do grep -q "build-cuda-remote:" $W/build-old.log 2>/dev/null && break; sleep 3; done

    for r in 1 2; do
        for v in build-old build; do
            $W/$v/still-cuda finetune -m $M --adapter $AD --data $D/austen/emma.txt --device cuda --tokens 393216 \
                --seq 1024 --batch 8 --val-max 2 -s 1 -o $R/sp-$v.gguf 2>&1 | grep -v "step [0-9]*/" |
                grep "training:\|wall\|before\|after\|error" | sed "s/^/$v still 1024x8 run $r: /"
        done
    done 2>&1 | tee $R/speed.txt
    for v in build-old build; do
        $W/$v/still-cuda finetune -m $M --adapter $AD --data $D/austen/emma.txt --device cuda --tokens 131072 \
            --seq 8192 --batch 1 --val-max 1 -s 1 -o $R/sp8-$v.gguf 2>&1 | grep -v "step [0-9]*/" |
            grep "training:\|wall\|before\|after\|error" | sed "s/^/$v still 8192x1: /"
    done 2>&1 | tee -a $R/speed.txt
    $S finetune -m $M --data $D/austen/emma.txt --device cuda --tokens 393216 --seq 1024 --batch 8 --val-max 2 -s 1 \
        -o $R/sp-soft.gguf 2>&1 | grep -v "step [0-9]*/" | grep "training:\|wall\|error" | sed "s/^/build softmax 1024x8: /" |
        tee -a $R/speed.txt
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $R/speed.txt
    cp $R/speed.txt $OUT/
    ;;
esac
