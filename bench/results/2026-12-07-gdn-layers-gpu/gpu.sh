#!/usr/bin/env bash
# Issue 29's quality table in one GPU run: which layers stay exact decides whether a gdn hybrid retrieves.
# `still probe` on the CPU (README here) found the 3 : 1 plan's softmax layers (3, 7, ..., 27) miss the layers where
# the teacher reads the needle (14, 17, 18, 20, 21, 22 are gdn there). Plans converted the same way (stage 1 on the
# GPU, 4M tokens of emma, mansfieldpark, prideandprejudice at 1024 x 4, lr 1e-2, seed 0):
#   r7      gdn everywhere but 7 softmax layers chosen by docs/layer-budgets.md's ranking (our own retrieval
#           templates in Emma, never the eval's): 7, 14, 17, 18, 20, 21, 23 -- the same memory as 3 : 1's 7
#   all     gdn in every layer
#   still4  gdn with every fourth layer still (3, 7, ..., 27; still's defaults, m = 896)
#   stillr7 gdn with still in r7's 7 layers
#   stillall  still in every layer (the same 4M-token recipe)
#   r7ft    r7 + stage 2 (1M tokens, LoRA q, k, v, o, lr 1e-4, seq 1024 x 8)
# plus the original (softmax) and the committed still adapter (stilldef: its much longer recipe, adapters/README.md).
# One GPU machine, /tmp/w. Calls, back to back (scripts/gpu-dist.sh made dist/a .. dist/e):
#   ../2026-12-07-gdn-gpu/gpu.sh start (dist/a), part b, part c, part d
#   gpu.sh go e        join the model, wait for the build, start `pipeline` (conversions, perplexity, stage 2) and
#                      `evals` (the six needle tasks at 1K-8K, 50 samples a cell) in the background
#   gpu.sh wait S      wait up to S seconds for both; progress and every result so far into $OUT
#   gpu.sh test2       test_finetune_cuda's gdn checks (STILL_TEST_GDN_ONLY=1, and on the trained r7 adapter)
#   gpu.sh speed       (alone on the GPU) bench_gdn_cuda against fla 0.6.0 (its wheels came in dist/e) at 1K-64K:
#                      prefill, and a decode step from the state at each depth; the whole model's decode at depth
#                      (still bench --device cuda) for gdn everywhere (the `all` adapter) and softmax
set -uo pipefail
W=/tmp/w R=/tmp/w/res5
M=$W/model.gguf
CALLER=$PWD
D=$W/data/austen
B=$W/build
G="gdn/conv=4:0-29,gdn/conv=4/norm=1:8-29"
plan_of() {
    case $1 in
    r7) echo "$G,softmax:7,14,17,18,20,21,23" ;;
    all) echo "$G" ;;
    still4) echo "$G,still:3,7,11,15,19,23,27" ;;
    stillr7) echo "$G,still:7,14,17,18,20,21,23" ;;
    stillall) echo "still:0-29" ;;
    esac
}
opts_of() {
    case $1 in
    softmax) echo "--attn softmax" ;;
    stilldef) echo "--adapter $W/stilldef.gguf" ;;
    *) echo "--adapter $R/$1-f16.gguf" ;;
    esac
}
log() { echo "$(date +%T) $*" >> $R/progress.txt; }
ppl() {   # ppl NAME: 32,768 tokens of Northanger Abbey at 2K, 4K, 8K
    for c in 2048 4096 8192; do
        echo "$1 | -c $c | $($B/still-cuda perplexity -m $M $(opts_of $1) -f $D/northangerabbey.txt -c $c \
            --chunks $((32768 / c)) --device cuda 2>&1 | tail -1)"
    done > $R/ppl-$1.txt 2>&1
}
convert() {   # convert NAME
    local name=$1
    OMP_NUM_THREADS=16 /usr/bin/time -v $B/still-cuda linearize -m $M --plan "$(plan_of $name)" --data $D/emma.txt \
        --data $D/mansfieldpark.txt --data $D/prideandprejudice.txt --tokens 4194304 --seq 1024 --batch 4 \
        --lr 1e-2 --device cuda -o $R/$name.gguf > $R/linearize-$name.txt 2>&1 || { log "linearize $name failed"; return 1; }
    $B/still-cuda convert -m $M --adapter $R/$name.gguf --outtype f16 -o $R/$name-f16.gguf.tmp > /dev/null 2>&1 &&
        mv $R/$name-f16.gguf.tmp $R/$name-f16.gguf
    log "converted $name: $(grep -E 'tok/s' $R/linearize-$name.txt | tail -1 | cut -c1-150)"
    ppl $name && log "ppl $name: $(cut -d'|' -f3,4 $R/ppl-$name.txt | tr '\n' ' ')"
}
cell() {   # one (configuration, task, length) cell, its own process
    local c=$1 t=$2 L=$3 E=$R/eval
    OMP_NUM_THREADS=1 timeout 560 $B/still-cuda eval $t -m $M --device cuda -b 4096 --lengths $L --samples 50 \
        --haystack $D/northangerabbey.txt --compare "$c=$(opts_of $c)" --json $E/$c-$t-$L.json.tmp > /dev/null \
        2> $E/$c-$t-$L.log && mv $E/$c-$t-$L.json.tmp $E/$c-$t-$L.json
}
case $1 in
go)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    for x in "${@:2}"; do cp $CALLER/dist/$x/model.part* $W/; done
    (cd $W && cat model.part* > model.gguf) && sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log 2>/dev/null && break; sleep 3; done
    tail -2 $W/build.log; grep -i " error" $W/build.log | head
    mkdir -p $R/eval; nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
    # the background jobs run from copies: each call replaces the tree they would otherwise read
    cp $0 $W/gpu5.sh && cp adapters/smollm2-135m-still.gguf $W/stilldef.gguf && cp scripts/eval-table.py $W/
    (cd $W && setsid nohup bash $W/gpu5.sh pipeline > $R/pipeline.log 2>&1 &)
    (cd $W && setsid nohup bash $W/gpu5.sh evals > $R/evals.log 2>&1 &)
    sleep 5; cat $R/progress.txt
    ;;
pipeline)
    log "pipeline start"; ppl softmax
    for n in r7 all still4; do convert $n; done
    OMP_NUM_THREADS=16 $B/still-cuda finetune -m $M --adapter $R/r7-f16.gguf --data $D/emma.txt --data $D/mansfieldpark.txt \
        --data $D/prideandprejudice.txt --tokens 1048576 --seq 1024 --batch 8 --lr 1e-4 --device cuda \
        -o $R/r7ft.gguf > $R/finetune-r7ft.txt 2>&1 && cp $R/r7ft.gguf $R/r7ft-f16.gguf
    log "stage 2 r7: $(grep -E 'val-after|tok/s' $R/finetune-r7ft.txt | tail -2 | cut -c1-140 | tr '\n' ' ')"
    ppl r7ft && log "ppl r7ft: $(cut -d'|' -f3,4 $R/ppl-r7ft.txt | tr '\n' ' ')"
    for n in stillr7 stillall; do convert $n; done
    ppl stilldef
    log "pipeline done"
    ;;
evals)
    for c in softmax r7 all still4 r7ft stillr7 stillall stilldef; do
        case $c in softmax | stilldef) ;; *)
            while [ ! -f $R/$c-f16.gguf ] && ! grep -q "pipeline done\|$c failed" $R/progress.txt; do sleep 5; done
            [ -f $R/$c-f16.gguf ] || continue ;;
        esac
        for L in 8k 4k 2k 1k; do
            for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multivalue passkey; do
                [ -f $R/eval/$c-$t-$L.json ] && continue
                while [ "$(jobs -rp | wc -l)" -ge 12 ]; do wait -n; done
                cell $c $t $L &
            done
        done
        wait
        python3 $W/eval-table.py $R/eval/$c-*.json > $R/eval-$c.md 2>&1
        log "eval $c: $(grep -c . $R/eval-$c.md) lines"
    done
    log "evals done"
    ;;
wait)
    for i in $(seq 1 $(( $2 / 5 ))); do
        grep -q "evals done" $R/progress.txt && grep -q "pipeline done" $R/progress.txt && break; sleep 5
    done
    cat $R/progress.txt; tail -n 3 $R/pipeline.log $R/evals.log
    tar -C $R -czf $OUT/res5.tar.gz --exclude='*.gguf' --exclude=gdnbench . 
    for f in $R/eval-*.md; do echo "== $f"; cat $f; done 2>/dev/null | tail -80
    ;;
speed)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $CALLER/dist/e/*.whl && export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/speed-device.txt
    timeout 60 $B/build-cuda/test_cuda_kernels --only gdn > $R/test_gdn.log 2>&1
    echo "test_cuda_kernels --only gdn exit $?"; grep -v "^PASS\|^ok" $R/test_gdn.log | tail -4
    mkdir -p $R/gdnbench
    L=1024,4096,8192,16384,32768,65536
    timeout 90 $B/build-cuda/bench_gdn_cuda $R/gdnbench --lengths $L 2>&1 | tee $R/bench_gdn.txt
    timeout 240 python3 $CALLER/scripts/bench-gdn-fla.py $R/gdnbench --lengths $L 2>&1 | tail -24 | tee $R/fla.txt
    for a in "--attn softmax" "--adapter $R/all-f16.gguf" "--adapter $R/r7-f16.gguf"; do
        echo "== $a"
        timeout 120 $B/still-cuda bench -m $M $a --device cuda -p 16384,65536 -n 0 -r 2 2>&1 | grep "|"
        timeout 120 $B/still-cuda bench -m $M $a --device cuda -p 0 -n 64 -d 1024,16384,65536 -r 2 2>&1 | grep "|"
    done 2>&1 | tee $R/bench_model.txt
    cp $R/speed-device.txt $R/test_gdn.log $R/bench_gdn.txt $R/fla.txt $R/bench_model.txt $OUT/
    ;;
test2)
    OMP_NUM_THREADS=16 STILL_TEST_GDN_ONLY=1 STILL_TEST_GDN_ADAPTER=$R/r7.gguf timeout 420 $B/test_finetune_cuda $M \
        $D/emma.txt > $R/test_finetune_cuda.log 2>&1
    echo "test_finetune_cuda exit $?"; grep -v "^PASS" $R/test_finetune_cuda.log | tail -25
    cp $R/test_finetune_cuda.log $OUT/
    ;;
esac
