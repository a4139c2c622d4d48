#!/usr/bin/env bash
# The GPU runs of 2026-12-04 (evening) for issues 25 and 26. One H200, /tmp/w. Calls, back to back:
#   gpu.sh start         (carries dist/a) unpack, build in the background
#   gpu.sh part b, part c
#   gpu.sh speed         (carries dist/d and .whl) join the model; the fine-tune's speed at seq 1024 x 8 on the
#                        softmax plan beside transformers + peft on the same GPU (two rounds), and on the committed
#                        still adapter; then stage 2 on SWA w2688 (issue 26's equal-memory comparison) in the background
#   gpu.sh profile       per-kernel times (ncu, gpu__time_duration) of a few training sequences: softmax plan, still adapter
#   gpu.sh swawait       SWA stage 2's log; when done the f16 file, then retrieval at 4K / 8K in four processes
#   gpu.sh evaltar N     waits for N JSON files, returns them in one archive
# After the trainer took whole batches in one pass (a second machine: start, part b, part c, then):
#   gpu.sh speed2        (carries dist/d) the fine-tune's speed again: softmax plan and still adapter at 1024 x 8,
#                        the still adapter at 8192 x 1
#   gpu.sh test          test_finetune_cuda MODEL emma.txt ADAPTER (every plan, and the batch cases)
#   gpu.sh peer2         (carries dist/d and .whl) the softmax-plan speed beside transformers + peft again, alternated
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
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    ;;
part)
    [ -d $W/res ] || { echo "gpu.sh: $W is not there (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && ls $W
    ;;
speed)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $CALLER/.whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -2 $W/build.log
    for r in 1 2; do
        $S finetune -m $M --data $D/austen/emma.txt --device cuda --tokens 786432 --seq 1024 --batch 8 --val-max 2 \
            -s 1 -o $R/peer-still-$r.gguf 2>&1 | grep -v "step [0-9]*/" | grep "training:\|wall\|tokens/s\|before\|after\|error"
        PYTHONUNBUFFERED=1 python3 scripts/bench-finetune-peer.py --model $M --text $D/austen/emma.txt --seq 1024 \
            --batch 8 --steps 24 --device cuda 2>&1 | tail -2
    done 2>&1 | tee $R/peer.txt
    $S finetune -m $M --adapter $AD --data $D/austen/emma.txt --device cuda --tokens 393216 --seq 1024 --batch 8 \
        --val-max 2 -s 1 -o $R/speed-still.gguf 2>&1 | grep -v "step [0-9]*/" |
        grep "training:\|wall\|tokens/s\|before\|after\|error" | sed 's/^/still adapter: /' | tee -a $R/peer.txt
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $R/peer.txt
    cp $R/peer.txt $OUT/
    (setsid nohup bash -c "/usr/bin/time -v $S finetune -m $M --attn swa --window 2688 $A --device cuda \
        --tokens 2097152 --seq 8192 --batch 1 --val-max 4 -s 5 -o $R/swa.tmp.gguf > $R/swa.log 2>&1; \
        echo rc=\$? >> $R/swa.log; mv $R/swa.tmp.gguf $R/swa-f32.gguf" > /dev/null 2>&1 &)
    ;;
profile)
    for what in softmax still; do
        X=""; [ $what = still ] && X="--adapter $AD"
        timeout 200 ncu --metrics gpu__time_duration.sum --csv --launch-skip ${SKIP:-25000} --launch-count ${COUNT:-12000} \
            $S finetune -m $M $X --data $D/austen/emma.txt --device cuda --tokens 131072 --seq 1024 --batch 8 \
            --val-max 1 -s 1 -o $R/prof-$what.gguf > $R/prof-$what.csv 2> $R/prof-$what.err
        python3 - $R/prof-$what.csv <<'PY' | tee $R/prof-$what.txt
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; rows = rows[1:]
ki, gi, vi, ui = h.index("Kernel Name"), h.index("Grid Size"), h.index("Metric Value"), h.index("Metric Unit")
tot = collections.Counter(); cnt = collections.Counter()
for r in rows:
    v = float(r[vi].replace(",", "")); v = v / 1e3 if r[ui] == "nsecond" else v if r[ui] == "usecond" else v * 1e3
    k = r[ki][:90]
    tot[k] += v; cnt[k] += 1
s = sum(tot.values())
print(f"{len(rows)} kernels, {s / 1e3:.1f} ms of kernel time")
for k, v in tot.most_common(40):
    print(f"{v / 1e3:9.2f} ms {100 * v / s:5.1f}% {cnt[k]:6d}x {v / cnt[k]:8.1f} us  {k}")
PY
        tail -3 $R/prof-$what.err
    done
    tar -C $R -czf $OUT/prof.tgz prof-softmax.txt prof-still.txt prof-softmax.csv prof-still.csv 2>/dev/null
    tail -c 300 $R/swa.log
    ;;
swawait)
    for i in $(seq 1 ${2:-180}); do grep -q "^rc=" $R/swa.log && break; sleep 3; done
    grep -v "step [0-9]*/" $R/swa.log | grep -v "^\s" | tail -12
    grep "Maximum resident\|Elapsed" $R/swa.log; cp $R/swa.log $OUT/
    [ -f $R/swa-f32.gguf ] || exit 1
    $S convert -m $M --adapter $R/swa-f32.gguf --outtype f16 -o $R/swa.gguf 2>&1 | tail -2
    sha256sum $R/swa-f32.gguf $R/swa.gguf; ls -l $R/swa.gguf
    for L in ${LENGTHS:-4096 8192}; do
        for T in niah_single_1,niah_single_2,niah_single_3 niah_multikey_1,niah_multivalue,passkey; do
            (setsid nohup bash -c "LENGTHS=$L TASKS=$T scripts/eval-retrieval-gpu.sh $S $M $R/swa.gguf \
                $D/austen/northangerabbey.txt $R/eval-swa-${T%%,*} 50 swa-s2 <(echo 'swa-s2|--adapter $R/swa.gguf') \
                > $R/eval-$L-${T%%,*}.log 2>&1" > /dev/null 2>&1 &)
        done
    done
    sleep 5; ls $R
    ;;
evaltar)  # evaltar N: waits for N JSON files, returns them in one archive
    for i in $(seq 1 ${3:-150}); do [ $(ls $R/eval-*/*.json 2>/dev/null | wc -l) -ge ${2:-4} ] && break; sleep 3; done
    (cd $R && tar -czf $OUT/eval.tgz eval-swa-* eval-*.log); ls $R/eval-*/; tail -n 2 $R/eval-*.log
    ;;
speed2)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -2 $W/build.log
    F="grep -v step\ [0-9]*/"
    for r in 1 2; do
        $S finetune -m $M --data $D/austen/emma.txt --device cuda --tokens 786432 --seq 1024 --batch 8 --val-max 2 \
            -s 1 -o $R/b-softmax-$r.gguf 2>&1 | grep "training:\|wall\|before\|after\|error" | sed "s/^/softmax $r: /"
    done 2>&1 | tee $R/speed2.txt
    $S finetune -m $M --adapter $AD --data $D/austen/emma.txt --device cuda --tokens 393216 --seq 1024 --batch 8 \
        --val-max 2 -s 1 -o $R/b-still.gguf 2>&1 | grep "training:\|wall\|before\|after\|error" |
        sed 's/^/still adapter 1024x8: /' | tee -a $R/speed2.txt
    $S finetune -m $M --adapter $AD $A --device cuda --tokens 262144 --seq 8192 --batch 1 --val-max 2 -s 5 \
        -o $R/b-still8k.gguf 2>&1 | grep "training:\|wall\|before\|after\|error" |
        sed 's/^/still adapter 8192x1: /' | tee -a $R/speed2.txt
    cp $R/speed2.txt $OUT/
    ;;
peer2)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $CALLER/.whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part* > model.gguf)
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    for r in 1 2; do
        $S finetune -m $M --data $D/austen/emma.txt --device cuda --tokens 786432 --seq 1024 --batch 8 --val-max 2 \
            -s 1 -o $R/p-$r.gguf 2>&1 | grep "training:\|wall" | sed "s/^/still softmax $r: /"
        PYTHONUNBUFFERED=1 python3 scripts/bench-finetune-peer.py --model $M --text $D/austen/emma.txt --seq 1024 \
            --batch 8 --steps 24 --device cuda 2>&1 | tail -1
    done 2>&1 | tee $R/peer2.txt; cp $R/peer2.txt $OUT/
    ;;
test)
    OMP_NUM_THREADS=8 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 | tee $R/test_finetune_cuda.log | tail -40
    cp $R/test_finetune_cuda.log $OUT/
    ;;
esac
