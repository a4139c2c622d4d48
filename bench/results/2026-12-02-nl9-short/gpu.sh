#!/usr/bin/env bash
# (the GPU run of 2026-12-02 that decides whether nl9 becomes the default:
# nl9 and the committed default on the six built-in tasks at 1K / 2K / 4K,
# Northanger Abbey, 50 samples a cell; /tmp/w as in scripts/build-cuda-remote.sh,
# third call of the three that carry dist/a, dist/b, dist/c)
cp dist/c/model.part02 /tmp/w/ && cd /tmp/w && cat model.part00 model.part01 model.part02 > model.gguf && mkdir -p data res && tar -C data -xJf data.tar.xz
for i in $(seq 1 100); do grep -q "build-cuda-remote:" build.log && break; sleep 3; done; tail -1 build.log
cd /tmp/w/src
W=/tmp/w R=$W/res S=$W/build/still-cuda M=$W/model.gguf A=adapters/smollm2-135m-still.gguf CFG=bench/results/2026-12-02-8k-gap/configs.txt
for L in 1k 2k 4k; do for c in nl9 still-chunk-m896; do i=0
    for T in niah_single_1,niah_multikey_1,passkey niah_single_2,niah_single_3,niah_multivalue; do i=$((i+1))
        TASKS=$T LENGTHS=$L setsid nohup scripts/eval-retrieval-gpu.sh $S $M $A $W/data/austen/northangerabbey.txt $R/g$i 50 $c $CFG > $R/$c-$L-$i.out 2>&1 &
    done; done; done
sleep 5; ls $R; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
