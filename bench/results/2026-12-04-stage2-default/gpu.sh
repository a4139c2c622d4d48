#!/usr/bin/env bash
# The GPU run of 2026-12-04 for issues 25/26: stage 2 of the committed adapter again (the same command and seed as
# 2026-12-03's, whose output was kept out of git and lost with that session's machine), the GPU trainer's tests with
# the review fixes and the lolcats case, and the 1K / 2K retrieval cells the stage-2 file lacked. One H200, /tmp/w.
# Calls, back to back:
#   gpu.sh start        (carries dist/a: libs, corpora, model part 0) unpack, build in the background
#   gpu.sh part b, part c
#   gpu.sh test         (carries dist/d) join the model, wait for the build, start stage 2 in the background, then
#                       test_finetune_cuda (still and lolcats cases) beside it
#   gpu.sh wait         stage 2's log; when done: the f16 file (still convert), checksums, then the retrieval
#                       cells at LENGTHS (default 1024,2048) in four processes
#   gpu.sh evalwait N   waits for N JSON files, copies them to $OUT
#   gpu.sh ppl          held-out perplexity of the new file at 512 / 2K / 4K / 8K
#   gpu.sh fetch        the f16 adapter to $OUT in two parts (cat s2.part* > FILE)
#   gpu.sh bench        decode on the H200 with the stage-2 adapter (LoRA applied on the fly) and without
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
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
part)
    [ -d $W/res ] || { echo "gpu.sh: $W is not there (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && ls $W
    ;;
test)
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part* > model.gguf) &&
        sha256sum $M
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    (setsid nohup bash -c "/usr/bin/time -v $S finetune -m $M --adapter $AD $A --device cuda --tokens 2097152 --seq 8192 \
        --batch 1 --val-max 4 -s 5 -o $R/s2.tmp.gguf > $R/s2.log 2>&1; echo rc=\$? >> $R/s2.log; \
        mv $R/s2.tmp.gguf $R/s2-f32.gguf" > /dev/null 2>&1 &)
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> $R/s2.mem.txt; sleep 2; done \
        > /dev/null 2>&1 &)
    STILL_TEST_STILL_ONLY=1 OMP_NUM_THREADS=8 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 |
        tee $R/test_finetune_cuda.log | tail -45
    cp $R/test_finetune_cuda.log $OUT/; tail -c 400 $R/s2.log
    ;;
wait)
    for i in $(seq 1 ${2:-180}); do grep -q "^rc=" $R/s2.log && break; sleep 3; done
    grep -v "step [0-9]*/" $R/s2.log | grep -v "^\s" | tail -12; grep "step 54/\|step 256/" $R/s2.log
    grep "Maximum resident\|Elapsed" $R/s2.log; echo "peak MiB on the device: $(sort -n $R/s2.mem.txt | tail -1)"
    cp $R/s2.log $R/s2.mem.txt $OUT/ 2>/dev/null
    [ -f $R/s2-f32.gguf ] || exit 1
    $S convert -m $M --adapter $R/s2-f32.gguf --outtype f16 -o $R/s2.gguf 2>&1 | tail -2
    sha256sum $R/s2-f32.gguf $R/s2.gguf $AD; ls -l $R/s2.gguf
    for L in ${LENGTHS:-1024 2048}; do
        for T in niah_single_1,niah_single_2,niah_single_3 niah_multikey_1,niah_multivalue,passkey; do
            (setsid nohup bash -c "LENGTHS=$L TASKS=$T scripts/eval-retrieval-gpu.sh $S $M $R/s2.gguf \
                $D/austen/northangerabbey.txt $R/eval-s2-${T%%,*} 50 s2 <(echo 's2|--adapter $R/s2.gguf') \
                > $R/eval-$L-${T%%,*}.log 2>&1" > /dev/null 2>&1 &)
        done
    done
    sleep 5; ls $R
    ;;
evalwait)
    for i in $(seq 1 ${2:-150}); do [ $(ls $R/eval-*/*.json 2>/dev/null | wc -l) -ge ${3:-4} ] && break; sleep 3; done
    mkdir -p $OUT/eval && cp -r $R/eval-s2-* $OUT/eval/ 2>/dev/null; ls $R/eval-*/; tail -n 3 $R/eval-*.log
    ;;
ppl)
    for c in 512 2048 4096 8192; do
        $S perplexity -m $M --adapter $R/s2.gguf --device cuda -f $D/austen/northangerabbey.txt -c $c \
            --chunks $((32768 / c)) 2>/dev/null | grep "^PPL" | tail -1 | sed "s#^#c=$c s2 #" | tee -a $R/ppl.txt
    done
    cp $R/ppl.txt $OUT/
    ;;
fetch)
    (cd $R && split -b 14500000 -d -a 1 s2.gguf s2.part && sha256sum s2.gguf && cp s2.part* $OUT/)
    ;;
again)  # (carries dist/d) a replaced machine: stage 2 in the foreground (no test), the f16 file, the evals of
        # TASKS (default the niah_single group) at LENGTHS in the background, perplexity, the file to $OUT
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part* > model.gguf)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    /usr/bin/time -v $S finetune -m $M --adapter $AD $A --device cuda --tokens 2097152 --seq 8192 --batch 1 \
        --val-max 4 -s 5 -o $R/s2-f32.gguf > $R/s2.log 2>&1; echo rc=$? >> $R/s2.log
    grep -v "step [0-9]*/" $R/s2.log | grep -v "^\s" | tail -8
    $S convert -m $M --adapter $R/s2-f32.gguf --outtype f16 -o $R/s2.gguf 2>&1 | tail -1
    sha256sum $R/s2-f32.gguf $R/s2.gguf
    T=${TASKS:-niah_single_1,niah_single_2,niah_single_3}
    for L in ${LENGTHS:-1024 2048}; do
        (setsid nohup bash -c "LENGTHS=$L TASKS=$T scripts/eval-retrieval-gpu.sh $S $M $R/s2.gguf \
            $D/austen/northangerabbey.txt $R/eval-s2-${T%%,*} 50 s2 <(echo 's2|--adapter $R/s2.gguf') \
            > $R/eval-$L-${T%%,*}.log 2>&1" > /dev/null 2>&1 &)
    done
    bash $0 ppl; bash $0 fetch; cp $R/s2.log $OUT/
    ;;
evaltar)  # evaltar N: waits for N JSON files, returns them in one archive
    for i in $(seq 1 ${2:-150}); do [ $(ls $R/eval-*/*.json 2>/dev/null | wc -l) -ge ${3:-2} ] && break; sleep 3; done
    (cd $R && tar -czf $OUT/eval.tgz eval-s2-* eval-*.log); ls $R/eval-*/; tail -n 2 $R/eval-*.log
    ;;
peer)   # (carries dist/d and .whl: the gguf package) the GPU fine-tune's speed beside transformers + peft, softmax
        # plan, seq 1024 x 8, one after the other on the same GPU
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $CALLER/.whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part* > model.gguf)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    for r in 1 2; do
        $S finetune -m $M --data $D/austen/emma.txt --device cuda --tokens 786432 --seq 1024 --batch 8 --val-max 2 \
            -s 1 -o $R/peer-still-$r.gguf 2>&1 | grep -v "step [0-9]*/" | grep "training:\|wall\|before\|after"
        PYTHONUNBUFFERED=1 python3 scripts/bench-finetune-peer.py --model $M --text $D/austen/emma.txt --seq 1024 \
            --batch 8 --steps 24 --device cuda 2>&1 | tail -2
    done | tee $R/peer.txt; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $R/peer.txt
    cp $R/peer.txt $OUT/
    ;;
bench)
    for a in $AD $R/s2.gguf; do
        $S bench -m $M --adapter $a --device cuda -p 512 -n 128 -d 0,8192,32768 2>&1 | tail -8
    done | tee $R/bench.txt; cp $R/bench.txt $OUT/
    ;;
esac
