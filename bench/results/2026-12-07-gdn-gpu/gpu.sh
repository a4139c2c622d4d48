#!/usr/bin/env bash
# The GPU run of 2026-12-07: the gdn kind's CUDA kernels (issue 29: cuda/kinds/gdn/attn_gdn.cu, its place in the
# model's forward and the CUDA-graph decode), and the checks left unrun on 2026-12-06 (issue 28's rules typed
# once, issue 25's bf16 batch check). One GPU machine, /tmp/w. Calls, back to back (scripts/gpu-dist.sh made
# dist/a .. dist/d; dist/q the libraries and the fla wheels alone; dist/g holds the fla wheels and a small gdn adapter trained on the CPU):
#   gpu.sh quick        (carries dist/q) no model: build in the foreground, test_cuda_kernels, gdn vs fla
#   gpu.sh start        (carries dist/a) unpack, build the tree into /tmp/w/build (in the background)
#   gpu.sh part X       (carries dist/X) for every part but the last
#   gpu.sh test X.. (carries dist/X..) the last parts; join the model; test_cuda_kernels (every group), test_model_cuda
#   gpu.sh gdn          (carries dist/g) the gdn adapter through test_model_cuda; bench_gdn_cuda against fla;
#                       perplexity CPU vs GPU and still bench of gdn plans against softmax
#   gpu.sh train        test_train_cuda and test_finetune_cuda (with the committed adapter)
#   gpu.sh same         perplexity of six plans, prefill and decode, against bench/results/2026-12-06-restructure-gpu
# dist/q, by hand: mkdir -p dist/q && cp dist/a/libs.tar.xz dist/q/ && python3 -m pip download --no-deps
#   --only-binary=:all: --python-version 3.12 --implementation cp --platform any -d dist/q
#   flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
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
gdnonly)   # (carries dist/q) the least: build the CUDA library and test_cuda_kernels alone, then its gdn group
    mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null; rm -rf $W/src/dist
    nvidia-smi --query-gpu=name --format=csv,noheader
    (cd $W/src && cmake -S cuda -B $W/bc -DCMAKE_BUILD_TYPE=Release > /dev/null &&
        timeout 400 cmake --build $W/bc -j "$(nproc)" --target test_cuda_kernels 2>&1 | grep -E "error|warning" ;
        echo "build done")
    timeout 60 $W/bc/test_cuda_kernels --only gdn 2>&1 | tee $OUT/test_gdn.log | tail -30
    ;;
quick)   # (carries dist/q: libs.tar.xz and the fla wheels) no model: build here, then the kernels' tests and bench
    mkdir -p $R && cp -r . $W/src/ 2>/dev/null; rm -rf $W/src/dist
    (cd $W/src && timeout 330 scripts/build-cuda-remote.sh $CALLER/dist/q/libs.tar.xz $W/build > $W/build.log 2>&1)
    echo "build exit $?"; tail -3 $W/build.log; nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 60 $W/build/build-cuda/test_cuda_kernels --only gdn 2>&1 | tee $R/test_gdn.log | tail -30
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $CALLER/dist/q/*.whl && export PYTHONPATH=/tmp/site
    mkdir -p $R/gdnbench $R/gdnbench3
    timeout 60 $W/build/build-cuda/bench_gdn_cuda $R/gdnbench --lengths 8192,1024,32768 2>&1 | tee $R/bench_gdn.txt
    timeout 40 $W/build/build-cuda/bench_gdn_cuda $R/gdnbench3 --lengths 8192,1024,32768 --heads 3 --kv-heads 3 2>&1 |
        tee -a $R/bench_gdn.txt
    timeout 120 python3 scripts/bench-gdn-fla.py $R/gdnbench --lengths 1024,8192,32768 2>&1 | tail -14 | tee $R/fla.txt
    cp $R/test_gdn.log $R/bench_gdn.txt $R/fla.txt $OUT/ 2>/dev/null
    timeout 200 $W/build/build-cuda/test_cuda_kernels > $R/test_cuda_kernels.log 2>&1
    echo "test_cuda_kernels exit $?"; grep -v "^PASS\|^ok" $R/test_cuda_kernels.log | tail -12
    cp $R/test_cuda_kernels.log $OUT/
    ;;
start)
    mkdir -p $W/data $R && cp $CALLER/dist/a/model.part00 $W/ && tar -C $D -xJf $CALLER/dist/a/data.tar.xz &&
        cp $CALLER/dist/a/libs.tar.xz $W/ && mkdir -p $W/src && cp -r . $W/src/ 2>/dev/null && rm -rf $W/src/dist
    (setsid nohup bash -c "cd $W/src && scripts/build-cuda-remote.sh $W/libs.tar.xz $W/build > $W/build.log 2>&1" \
        > /dev/null 2>&1 &)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
part)
    [ -d $R ] || { echo "gpu.sh: $W is not there (a new machine? run start first)" >&2; exit 1; }
    cp $CALLER/dist/$2/model.part* $W/ && ls $W
    ;;
test)
    [ -f $W/build.log ] || { echo "gpu.sh: no build was started here (a new machine? run start first)" >&2; exit 1; }
    for x in "${@:2}"; do cp $CALLER/dist/$x/model.part* $W/; done
    (cd $W && cat model.part* > model.gguf) && sha256sum $M
    wait_build $W/build.log
    grep -i "error" $W/build.log | head -20
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
    timeout 420 $W/build/build-cuda/test_cuda_kernels > $R/test_cuda_kernels.log 2>&1
    echo "test_cuda_kernels exit $?"; grep -v "^PASS\|^ok" $R/test_cuda_kernels.log | tail -25
    grep "gdn" $R/test_cuda_kernels.log | head -30
    cp $R/test_cuda_kernels.log $OUT/
    for a in "" "$AD"; do
        OMP_NUM_THREADS=8 timeout 150 $W/build/test_model_cuda $M 900 $a 2>&1 | grep -v "^PASS" | sed "s|^|test_model_cuda ${a:-softmax}: |"
    done 2>&1 | tee $R/test_model_cuda.txt
    cp $R/test_model_cuda.txt $OUT/
    ;;
gdn)
    G=$CALLER/dist/g GA=$CALLER/dist/g/gdn-6.gguf
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/*.whl &&
        export PYTHONPATH=/tmp/site
    OMP_NUM_THREADS=8 STILL_TEST_GDN_ADAPTER=$GA timeout 150 $W/build/test_model_cuda $M 900 $AD 2>&1 |
        grep "gdn\|passed" | tee $R/test_model_cuda_gdn.txt
    mkdir -p $R/gdnbench $R/gdnbench3
    { $W/build/build-cuda/bench_gdn_cuda $R/gdnbench --lengths 8192,1024,4096,32768 &&
      $W/build/build-cuda/bench_gdn_cuda $R/gdnbench3 --lengths 8192,1024,4096,32768 --heads 3 --kv-heads 3 ; } 2>&1 |
        tee $R/bench_gdn.txt
    timeout 240 python3 scripts/bench-gdn-fla.py $R/gdnbench --lengths 1024,4096,8192,32768 2>&1 | tail -20 | tee $R/fla.txt
    F=$D/austen/northangerabbey.txt
    for plan in "--adapter $GA" "--attn gdn"; do
        for dev in cpu cuda; do
            for b in 512 1; do
                c=2048; [ $b = 1 ] && c=512
                [ $dev = cpu ] && [ $b = 1 ] && continue
                r=$(OMP_NUM_THREADS=16 $W/build/still-cuda perplexity -m $M -f $F -c $c --chunks 2 -b $b --device $dev $plan 2>&1 | tail -1)
                echo "$plan | $dev | -c $c -b $b | $r"
            done
        done
    done 2>&1 | tee $R/gdn_ppl.txt
    for plan in "--attn softmax" "--attn gdn" "--adapter $GA"; do
        $W/build/still-cuda bench -m $M --device cuda $plan -p 512,4096 -n 128 -r 3 2>&1 | grep "| pp\|| tg" | sed "s|^|$plan: |"
        $W/build/still-cuda bench -m $M --device cuda $plan -p 0 -n 64 -d 1024,16384 -r 2 2>&1 | grep "| tg" | sed "s|^|$plan: |"
    done 2>&1 | tee $R/gdn_speed.txt
    cp $R/test_model_cuda_gdn.txt $R/bench_gdn.txt $R/fla.txt $R/gdn_ppl.txt $R/gdn_speed.txt $OUT/
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
    F=$D/austen/northangerabbey.txt
    for plan in "--attn softmax" "--adapter $AD" "--attn swa --window 256" "--attn liger --window 64" \
                "--attn lolcats" "--attn still"; do
        for b in 512 1; do
            c=2048; [ $b = 1 ] && c=512
            r=$($W/build/still-cuda perplexity -m $M -f $F -c $c --chunks 2 -b $b --device cuda $plan 2>&1 | tail -1)
            echo "build | $plan | -c $c -b $b | $r"
        done
    done 2>&1 | tee $R/same.txt
    $W/build/still-cuda bench -m $M --adapter $AD --device cuda -p 4096 -n 128 -r 3 2>&1 | grep "| pp\|| tg" | tee $R/bench.txt
    cp $R/same.txt $R/bench.txt $OUT/
    ;;
esac
