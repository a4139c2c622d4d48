#!/usr/bin/env bash
# The GPU run of 2026-12-03 (second session) for issue 26: the committed adapter (step 8: Sel in 8 bits,
# eight exact layers, 65.01 MiB of attention state) on the six built-in needle tasks at 1K-8K, 50 prompts a
# cell, on the held-out Northanger Abbey; the decode step's keys per block (STILL_CUDA_DECODE_SPLIT) at depth.
# One H200, /tmp/w as in scripts/build-cuda-remote.sh. Calls, back to back:
#   gpu.sh start   (carries dist/a: libs, corpora, model part 0) unpack, build in the background
#   gpu.sh part b, gpu.sh part c   (carry dist/b, dist/c: model parts 1 and 2)
#   gpu.sh tests   (carries dist/d: model part 3) join the model, wait for the build, the still kernels'
#                  tests at the default split and at 128 and auto; then the retrieval cells in the background
#   gpu.sh bench   decode at depth for each split (after the retrieval cells: alone on the GPU)
#   gpu.sh collect results into $OUT
# After the merge kernel's rewrite, on a fresh machine: start, part b, part c, then
#   gpu.sh merge   (carries dist/d) the still tests at splits 32 and 64, decode at depth per split
set -uo pipefail
W=/tmp/w R=/tmp/w/res
S=$W/build/still-cuda M=$W/model.gguf A=$W/ad/step8.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
export OMP_NUM_THREADS=2
H1=niah_single_1,niah_multikey_1,passkey H2=niah_single_2,niah_single_3,niah_multivalue
case $1 in
start)
    mkdir -p $W/ad $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null
    (cd $W/src && setsid nohup scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build > $W/build.log 2>&1 &)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    ;;
part)   # gpu.sh part b|c: that part of the model
    cp $CALLER/dist/$2/model.part* $W/ && ls -la $W
    ;;
tests)
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part00 model.part01 model.part02 model.part03 > model.gguf) &&
        sha256sum $M && cp adapters/smollm2-135m-still.gguf $A && sha256sum $A
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    echo "step8|--adapter $A" > $R/configs.txt
    for L in 1k 2k 4k 8k; do
        TASKS=$H1 LENGTHS=$L setsid nohup $W/src/scripts/eval-retrieval-gpu.sh $S $M $A $D/austen/northangerabbey.txt $R/test1 50 step8 $R/configs.txt > $R/test-$L-1.out 2>&1 &
        TASKS=$H2 LENGTHS=$L setsid nohup $W/src/scripts/eval-retrieval-gpu.sh $S $M $A $D/austen/northangerabbey.txt $R/test2 50 step8 $R/configs.txt > $R/test-$L-2.out 2>&1 &
    done
    for sp in default 128 auto; do
        if [ $sp = default ]; then $W/build/build-cuda/test_cuda_kernels --only still > $R/tck-$sp.log 2>&1
        else STILL_CUDA_DECODE_SPLIT=$sp $W/build/build-cuda/test_cuda_kernels --only still > $R/tck-$sp.log 2>&1; fi
        echo "test_cuda_kernels split $sp rc=$?"; grep -E "FAIL|passed" $R/tck-$sp.log | tail -4
    done
    ;;
merge)   # second machine, after the merge kernel's rewrite: its tests at splits 32 and 64, then decode per split
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part00 model.part01 model.part02 model.part03 > model.gguf) &&
        sha256sum $M && cp adapters/smollm2-135m-still.gguf $A
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    for sp in 32 64; do
        STILL_CUDA_DECODE_SPLIT=$sp $W/build/build-cuda/test_cuda_kernels --only still > $R/tck2-$sp.log 2>&1
        echo "test_cuda_kernels split $sp rc=$?"; grep -E "FAIL|passed" $R/tck2-$sp.log | tail -4
    done
    for sp in 32 64 auto; do
        STILL_CUDA_DECODE_SPLIT=$sp $S bench -m $M --adapter $A --device cuda -p 0 -n 128 -r 3 -d 1024,8192,32768 2>&1 |
            grep "| tg128" | sed "s#^#split $sp #" | tee -a $R/bench2-split.txt
    done
    tar -C $R -czf $OUT/res2.tgz .
    ;;
bench)
    for sp in 32 64 128 auto; do
        STILL_CUDA_DECODE_SPLIT=$sp $S bench -m $M --adapter $A --device cuda -p 0 -n 128 -r 3 -d 1024,8192,32768 2>&1 |
            grep "tg128" | sed "s#^#split $sp #" | tee -a $R/bench-split.txt
    done
    ;;
collect)
    ls $R/test*/ 2>/dev/null | grep -c json
    tail -n 2 $R/*.out 2>/dev/null | grep -v "^$" | tail -30
    tar -C $R -czf $OUT/res.tgz .
    ;;
esac
