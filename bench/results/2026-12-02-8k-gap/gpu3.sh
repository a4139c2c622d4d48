# (the GPU run of 2026-12-02, third machine: dev8k + held-out ppl + the test tasks at 8K for nl5 / nl9)
cp dist/c/model.part02 /tmp/w/ && cd /tmp/w && cat model.part00 model.part01 model.part02 > model.gguf && mkdir -p data && tar -C data -xJf data.tar.xz && for i in $(seq 1 100); do grep -q "build-cuda-remote:" build.log && break; sleep 3; done; tail -1 build.log
cd /tmp/w/src && bash bench/results/2026-12-02-8k-gap/run-gpu.sh dev8k nl5 nl9
W=/tmp/w R=$W/res S=$W/build/still-cuda M=$W/model.gguf A=adapters/smollm2-135m-still.gguf CFG=bench/results/2026-12-02-8k-gap/configs.txt
for c in "nl5|--no-linear-layers 14-15,20-22" "nl9|--no-linear-layers 6,8,14-15,19-22,24"; do n=${c%%|*} o=${c#*|}; (setsid nohup bash -c "for L in 2048 4096 8192; do $S perplexity -m $M --adapter $A $o --device cuda -c \$L --chunks \$((32768 / \$L)) -f $W/data/austen/northangerabbey.txt 2>&1 | tail -1 | sed \"s#^#$n \$L: #\"; done" > $R/ppl-$n.txt 2>&1 &); done
for c in nl5 nl9; do i=0; for T in niah_single_1,niah_multikey_1,passkey niah_single_2,niah_single_3,niah_multivalue; do i=$((i+1)); TASKS=$T LENGTHS=8k setsid nohup scripts/eval-retrieval-gpu.sh $S $M $A $W/data/austen/northangerabbey.txt $R/test$i 50 $c $CFG > $R/test-$c-$i.out 2>&1 & done; done
sleep 2; ls $R
