#!/usr/bin/env bash
# gdn's stage 1 on the GPU (issue 29; written 2026-12-07, NOT YET RUN: no device time was left that day).
# stc_gdn_distill (cuda/kinds/gdn/attn_gdn.cu) and its place in the stage-1 trainer (src/train/train_cuda.c).
# One GPU machine, /tmp/w. Calls, back to back (scripts/gpu-dist.sh made dist/a .. dist/e; dist/q the libraries
# and fla's wheels, see ../2026-12-07-gdn-gpu/gpu.sh):
#   ../2026-12-07-gdn-fast-gpu/gpu.sh kern   (dist/q) test_cuda_kernels --only gdn (the no-norm cases), the suite
#   ../2026-12-07-gdn-gpu/gpu.sh start (dist/a), part b, part c, test d e   (the model; test_model_cuda)
#   gpu.sh train     test_train_cuda: gdn_grad_check (stc_gdn_distill against the CPU kind's step) and the
#                    trainer comparison with every layer gdn (GPU against the CPU trainer)
#   gpu.sh convert   stage 1 on the GPU: the 3 : 1 plan with the norm off in layers 0-7 (the best of
#                    ../2026-12-07-gdn-norm-cpu/), 64K tokens (against the CPU's 794.39 at -c 512) and 4M tokens;
#                    Northanger Abbey's perplexity of each at 512 and 2048
#   gpu.sh convad    (carries dist/g2: runs/gdn31-conv-512k-f16.gguf, the CPU-trained 3 : 1 plan with conv 4, made by
#                    `still convert --adapter runs/norm-3to1-conv-all-512k.gguf --outtype f16`; CPU perplexity 51.8698
#                    at -c 512 --chunks 8) through test_model_cuda and the GPU's perplexity (the conv forward)
set -uo pipefail
W=/tmp/w R=/tmp/w/res3
M=$W/model.gguf
CALLER=$PWD
cd "$(dirname "$0")/../../.."
D=$W/data/austen
mkdir -p $R
case $1 in
train)
    OMP_NUM_THREADS=8 timeout 400 $W/build/test_train_cuda $M $D/emma.txt > $R/test_train_cuda.log 2>&1
    echo "test_train_cuda exit $?"; grep -v "^PASS" $R/test_train_cuda.log | tail -20; grep "gdn" $R/test_train_cuda.log
    cp $R/test_train_cuda.log $OUT/
    ;;
convert)
    P="gdn:0-29,gdn/norm=1:8-29,softmax:3,7,11,15,19,23,27"
    for tok in 65536 4194304; do
        /usr/bin/time -v $W/build/still-cuda linearize -m $M --plan "$P" --data $D/emma.txt --data $D/mansfieldpark.txt \
            --data $D/prideandprejudice.txt --tokens $tok --seq 512 --batch 4 --lr 1e-2 --device cuda \
            -o $R/gdn31-$tok.gguf > $R/linearize-$tok.txt 2>&1
        echo "linearize $tok exit $?"; grep -E "training:|wall time|Maximum resident" $R/linearize-$tok.txt
        for c in 512 2048; do
            n=8; [ $c = 2048 ] && n=4
            echo "$tok | -c $c | $($W/build/still-cuda perplexity -m $M --adapter $R/gdn31-$tok.gguf -f $D/northangerabbey.txt -c $c --chunks $n --device cuda 2>&1 | tail -1)"
        done
    done 2>&1 | tee $R/convert.txt
    cp $R/convert.txt $R/linearize-*.txt $OUT/
    ;;
convad)
    A=$(ls $CALLER/dist/g2/*.gguf 2>/dev/null | head -1)
    [ -n "$A" ] || { echo "gpu.sh convad: no adapter in dist/g2" >&2; exit 1; }
    OMP_NUM_THREADS=8 STILL_TEST_GDN_ADAPTER=$A timeout 200 $W/build/test_model_cuda $M 900 2>&1 | grep "gdn\|passed" |
        tee $R/test_model_cuda_conv.txt
    for c in 512 2048; do
        n=8; [ $c = 2048 ] && n=4
        for b in 512 1; do
            [ $b = 1 ] && [ $c = 2048 ] && continue
            echo "conv adapter | -c $c -b $b | $($W/build/still-cuda perplexity -m $M --adapter $A -f $D/northangerabbey.txt -c $c --chunks $n -b $b --device cuda 2>&1 | tail -1)"
        done
    done | tee $R/convad_ppl.txt
    $W/build/still-cuda bench -m $M --adapter $A --device cuda -p 512,4096 -n 128 -r 3 2>&1 | grep "| pp\|| tg" |
        tee $R/convad_speed.txt
    cp $R/test_model_cuda_conv.txt $R/convad_ppl.txt $R/convad_speed.txt $OUT/
    ;;
esac
