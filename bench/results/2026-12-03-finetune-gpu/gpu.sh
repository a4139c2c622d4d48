#!/usr/bin/env bash
# The GPU run of 2026-12-03 for issue 25: stage 2 on the GPU (src/train_lm_cuda.c, softmax and swa plans).
# One H200, /tmp/w as in scripts/build-cuda-remote.sh. Calls, back to back:
#   gpu.sh start   (carries dist/a: libs, corpora, model part 0) unpack, build in the background
#   gpu.sh part b, gpu.sh part c   (carry dist/b, dist/c: model parts 1 and 2)
#   gpu.sh run     (carries dist/d) join the model, wait for the build; test_finetune_cuda (GPU against the CPU
#                  trainer); the same short fine-tune on the CPU (16 threads) and the GPU; a speed run at
#                  seq 1024 x 8 on the GPU with device memory sampled (SPEED_TOKENS, default 655360: the first call;
#                  the second, after the graphs, ran SPEED_TOKENS=2621440 and then the held-out perplexity of the
#                  base model and the fine-tuned one); everything into $OUT
set -uo pipefail
W=/tmp/w R=/tmp/w/res
S=$W/build/still-cuda M=$W/model.gguf SPEED_TOKENS=${SPEED_TOKENS:-655360}
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data
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
run)
    cp $CALLER/dist/d/model.part03 $W/ && (cd $W && cat model.part00 model.part01 model.part02 model.part03 > model.gguf) &&
        sha256sum $M
    for i in $(seq 1 200); do grep -q "build-cuda-remote:" $W/build.log && break; sleep 3; done
    tail -3 $W/build.log
    OMP_NUM_THREADS=16 $W/build/test_finetune_cuda $M $D/austen/emma.txt 2>&1 | tee $R/test_finetune_cuda.log | tail -16
    F="--data $D/jargon.txt --tokens 8192 --seq 256 --batch 4 --lr 1e-3 -s 3 --val-max 4"
    /usr/bin/time -v $S finetune -m $M $F -t 16 -o $R/ft-cpu.gguf > $R/ft-cpu.log 2>&1; echo "cpu rc=$?"
    /usr/bin/time -v $S finetune -m $M $F --device cuda -o $R/ft-gpu.gguf > $R/ft-gpu.log 2>&1; echo "gpu rc=$?"
    grep -E "val|loss|tokens/s" $R/ft-cpu.log | tail -4; grep -E "val|loss|tokens/s" $R/ft-gpu.log | tail -4
    A="--data $D/python-docs.txt --data $D/jargon.txt --data $D/austen/emma.txt --data $D/austen/mansfieldpark.txt
       --data $D/austen/prideandprejudice.txt --data $D/austen/senseandsensibility.txt"
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> $R/mem.txt; sleep 1; done) &
    MP=$!
    $S finetune -m $M $A --device cuda --tokens $SPEED_TOKENS --seq 1024 --batch 8 --val-max 8 -o $R/ft-speed.gguf \
        > $R/ft-speed.log 2>&1; echo "speed rc=$?"
    kill $MP
    grep -v "step [0-9]*/" $R/ft-speed.log | tail -12; echo "peak MiB used: $(sort -n $R/mem.txt | tail -1)"
    if [ "$SPEED_TOKENS" -gt 1000000 ]; then   # the control's held-out perplexity (Northanger Abbey, never trained on)
        for c in 512 2048; do
            for a in "" "--adapter $R/ft-speed.gguf"; do
                $S perplexity -m $M $a --device cuda -f $D/austen/northangerabbey.txt -c $c --chunks $((32768 / c)) 2>&1 |
                    grep -i "perplexity" | tail -1 | sed "s#^#c=$c ${a:+finetuned} #" | tee -a $R/ppl.txt
            done
        done
    fi
    cp $R/*.log $R/mem.txt $R/ppl.txt $OUT/ 2>/dev/null; cp $R/ft-cpu.gguf $R/ft-gpu.gguf $OUT/
    ;;
esac
