#!/usr/bin/env bash
# The GPU run of 2026-12-03 (evening) for issue 25: stage 2 for still plans on the GPU (src/train_lm_cuda.c with
# cuda/train_lm_still.cu). One H200, /tmp/w as in scripts/build-cuda-remote.sh. Calls, back to back:
#   gpu.sh start            (carries dist/a: libs, corpora, model part 0) unpack, build in the background
#   gpu.sh part b, part c   (carry dist/b, dist/c: model parts 1 and 2)
#   gpu.sh test             (carries dist/d) join the model, wait for the build; test_finetune_cuda with the
#                           committed still adapter (the GPU trainer against the CPU trainer and finite differences)
#   gpu.sh stage2 NAME ARGS (background) still finetune on the committed adapter, ARGS appended; then poll with
#   gpu.sh control NAME ARGS   the same on the softmax plan (the base model)
#   gpu.sh wait NAME        (prints the log's tail; copies the results to $OUT when done)
#   gpu.sh adapter          (a later session, carries dist/s2) the stage-2 adapter as s2-8k, for eval / ppl
#   gpu.sh ppl NAME...      held-out perplexity (Northanger Abbey) at 512 / 2K / 4K / 8K of the original model, the
#                           adapter and each fine-tuned NAME
set -uo pipefail
W=/tmp/w R=/tmp/w/res
S=$W/build/still-cuda M=$W/model.gguf AD=adapters/smollm2-135m-still.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
A="--data $D/python-docs.txt --data $D/jargon.txt --data $D/austen/emma.txt --data $D/austen/mansfieldpark.txt"
A="$A --data $D/austen/prideandprejudice.txt --data $D/austen/senseandsensibility.txt"
case $1 in
start)
    mkdir -p $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null
    (cd $W/src && setsid nohup scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build > $W/build.log 2>&1 &)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    ;;
part)
    cp $CALLER/dist/$2/model.part* $W/ && ls $W
    ;;
adapter)   # a later session (carries dist/s2): the stage-2 adapter kept out of git, as s2-8k (f16 stage-1 tensors)
    mkdir -p $R && cp $CALLER/dist/s2/smollm2-135m-still-s2.gguf $R/s2-8k.gguf && sha256sum $R/s2-8k.gguf
    ;;
rebuild)   # the working tree again, built again (incrementally), then the still cases of the test only
    cp -r . $W/src/ 2>/dev/null && (cd $W/src && scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build 2>&1 | tail -3)
    STILL_TEST_STILL_ONLY=1 OMP_NUM_THREADS=16 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 |
        tee $R/test_finetune_cuda_still.log | tail -${TAIL:-40}
    cp $R/test_finetune_cuda_still.log $OUT/
    ;;
test)
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part00 model.part01 model.part02 model.part03 > model.gguf) &&
        sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    OMP_NUM_THREADS=16 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 | tee $R/test_finetune_cuda.log | tail -40
    cp $R/test_finetune_cuda.log $OUT/
    ;;
stage2|control)   # control: the softmax plan (the base model, no adapter)
    [ $1 = control ] && AD=""
    N=$2; shift 2
    (setsid nohup bash -c "/usr/bin/time -v $S finetune -m $M ${AD:+--adapter $AD} $A --device cuda $* -o $R/$N.tmp.gguf \
        > $R/$N.log 2>&1; echo rc=\$? >> $R/$N.log; mv $R/$N.tmp.gguf $R/$N.gguf" > /dev/null 2>&1 &)
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> $R/$N.mem.txt; sleep 2; done \
        > /dev/null 2>&1 &)
    sleep 60; tail -c 600 $R/$N.log
    ;;
wait)
    N=$2
    for i in $(seq 1 ${3:-180}); do grep -q "^rc=" $R/$N.log && break; sleep 3; done
    grep -v "step [0-9]*/" $R/$N.log | tail -30; tail -c 300 $R/$N.log; echo
    echo "peak MiB used: $(sort -n $R/$N.mem.txt | tail -1)"
    cp $R/$N.log $R/$N.mem.txt $OUT/ 2>/dev/null
    ;;
eval)   # eval NAME LENGTH: the six needle tasks, 50 prompts, held-out haystack, NAME's adapter (two processes)
    N=$2 L=$3
    for T in niah_single_1,niah_single_2,niah_single_3 niah_multikey_1,niah_multivalue,passkey; do
        (setsid nohup bash -c "LENGTHS=$L TASKS=$T scripts/eval-retrieval-gpu.sh $S $M $R/$N.gguf $D/austen/northangerabbey.txt \
            $R/eval-$N-${T%%,*} 50 $N <(echo '$N|--adapter $R/$N.gguf') > /dev/null 2>&1" > /dev/null 2>&1 &)
    done
    ;;
evalwait)
    for i in $(seq 1 ${2:-150}); do [ $(ls $R/eval-*/*.json 2>/dev/null | wc -l) -ge ${3:-2} ] && break; sleep 3; done
    mkdir -p $OUT/eval && cp -r $R/eval-* $OUT/eval/ 2>/dev/null; ls $R/eval-*/
    ;;
ppl)
    shift
    for c in 512 2048 4096 8192; do
        for a in "" "$AD" $(for n in "$@"; do echo "$R/$n.gguf"; done); do
            $S perplexity -m $M ${a:+--adapter $a} --device cuda -f $D/austen/northangerabbey.txt -c $c --chunks $((32768 / c)) 2>/dev/null |
                grep "^PPL" | tail -1 | sed "s#^#c=$c ${a:-original} #" | tee -a $R/ppl.txt
        done
    done
    cp $R/ppl.txt $OUT/
    ;;
esac
