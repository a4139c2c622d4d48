#!/usr/bin/env bash
# The GPU runs of 2026-12-05 (late evening) for issue 25: the still layers' fused training attention
# (cuda/attn_still_train.cu) and the fp16 score products of the fused softmax attention. One GPU, /tmp/w. Calls,
# back to back:
#   gpu.sh start         (carries dist/a) unpack; build this tree into /tmp/w/build and, when old-src/ is there
#                        (src/train_lm_cuda.c with the still layers dense, not committed), that tree into /tmp/w/build-old
#   gpu.sh part b        (carries dist/b), and so on for every part but the last
#   gpu.sh kernels LAST  (carries dist/LAST) join the model; test_cuda_kernels --only still-train, flash-train
#   gpu.sh ft            test_finetune_cuda, the whole suite (still, lolcats, softmax, swa against the CPU trainer)
#   gpu.sh speed         the committed still adapter's fine-tune at 1024 x 8, before and after, alternated, twice;
#                        the softmax plan beside them
#   gpu.sh all LAST      kernels LAST, the routing's test (--only still-lm-route), ft and speed in one call
#   gpu.sh profile       per-kernel times (ncu, gpu__time_duration) of the still adapter's fine-tune at 1024 x 8
set -uo pipefail
W=/tmp/w R=/tmp/w/res
S=$W/build/still-cuda M=$W/model.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
AD=adapters/smollm2-135m-still.gguf
wait_build() { for i in $(seq 1 200); do grep -q "build-cuda-remote:" $1 2>/dev/null && break; sleep 3; done; tail -1 $1; }
case $1 in
start)
    mkdir -p $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null
    if [ -d old-src ]; then
        mkdir -p $W/src-old && cp -r . $W/src-old/ && cp old-src/train_lm_cuda.c $W/src-old/src/
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
kernels)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    wait_build $W/build.log
    grep -i "error" $W/build.log | head -20
    for g in still-train flash-train; do
        $W/build/build-cuda/test_cuda_kernels --only $g 2>&1 | tee $R/test_$g.log | grep -v "^PASS" | tail -30
    done
    cp $R/test_*.log $OUT/
    ;;
ft)
    OMP_NUM_THREADS=8 timeout 560 $W/build/test_finetune_cuda $M $D/austen/emma.txt $AD 2>&1 |
        tee $R/test_finetune_cuda.log | grep -v "^PASS" | tail -30
    cp $R/test_finetune_cuda.log $OUT/
    ;;
speed)
    wait_build $W/build-old.log
    for r in 1 2; do
        for v in build-old build; do
            $W/$v/still-cuda finetune -m $M --adapter $AD --data $D/austen/emma.txt --device cuda --tokens 393216 \
                --seq 1024 --batch 8 --val-max 2 -s 1 -o $R/sp-$v.gguf 2>&1 | grep -v "step [0-9]*/" |
                grep "training:\|wall\|before\|after\|error" | sed "s/^/$v still 1024x8 run $r: /"
        done
    done 2>&1 | tee $R/speed.txt
    $S finetune -m $M --data $D/austen/emma.txt --device cuda --tokens 786432 --seq 1024 --batch 8 --val-max 2 -s 1 \
        -o $R/sp-soft.gguf 2>&1 | grep -v "step [0-9]*/" | grep "training:\|wall\|error" |
        sed "s/^/build softmax 1024x8: /" | tee -a $R/speed.txt
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $R/speed.txt
    cp $R/speed.txt $OUT/
    ;;
profile)
    # profile LAST on a machine where test did not run: join the model first
    [ $# -ge 2 ] && cp $CALLER/dist/$2/model.part* $W/ && (cd $W && cat model.part* > model.gguf) && sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    for what in ${WHAT:-still}; do
        X=""; [ $what = still ] && X="--adapter $AD"
        timeout 250 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip ${SKIP:-20000} \
            --launch-count ${COUNT:-8000} $S finetune -m $M $X --data $D/austen/emma.txt --device cuda --tokens 131072 \
            --seq 1024 --batch 8 --val-max 1 -s 1 -o $R/prof-$what.gguf > $R/prof-$what.csv 2> $R/prof-$what.err
        python3 - $R/prof-$what.csv <<'PY' | tee $R/prof-$what.txt | head -30
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; rows = rows[1:]
ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
tot = collections.Counter(); cnt = collections.Counter()
for r in rows:
    v = float(r[vi].replace(",", "")); v = v / 1e3 if r[ui] in ("ns", "nsecond") else v if r[ui] in ("us", "usecond") else v * 1e3
    k = r[ki][:90]
    tot[k] += v; cnt[k] += 1
s = sum(tot.values())
print(f"{len(rows)} kernels, {s / 1e3:.1f} ms of kernel time")
for k, v in tot.most_common(40):
    print(f"{v / 1e3:9.2f} ms {100 * v / s:5.1f}% {cnt[k]:6d}x {v / cnt[k]:8.1f} us  {k}")
PY
        tail -2 $R/prof-$what.err
    done
    cp $R/prof-*.txt $OUT/
    ;;
all)
    # all LAST: kernels LAST, the routing's test, ft and speed in one call
    bash "$0" kernels $2
    $W/build/build-cuda/test_cuda_kernels --only still-lm-route > $R/test_route.log 2>&1; tail -1 $R/test_route.log
    cp $R/test_route.log $OUT/
    bash "$0" ft
    bash "$0" speed
    ;;
*)
    echo "usage: gpu.sh start | part X | kernels LAST | ft | speed" >&2
    exit 2
    ;;
esac
