#!/usr/bin/env bash
# The second GPU run of 2026-12-07 (issue 29): gdn's kernels restructured so that only the state walks the
# chunks in order (cuda/kinds/gdn/attn_gdn.cu: chunk -> W, U; scan -> the states and E, with cp.async prefetch;
# out -> P, O, norm and gate, every (chunk, query head) at once) and a one-token decode kernel of the recurrent
# form. One GPU machine, /tmp/w.
#   gpu.sh kern     (carries dist/q: fla's wheels) build the CUDA kernels' programs only; test_cuda_kernels --only
#                   gdn, bench_gdn_cuda, fla in the same call, then test_cuda_kernels in full
# then the model, with ../2026-12-07-gdn-gpu/gpu.sh start (dist/a), part b, part c, test d e, gdn (dist/g).
set -uo pipefail
W=/tmp/w R=/tmp/w/res2
CALLER=$PWD
cd "$(dirname "$0")/../../.."
case $1 in
kern)
    mkdir -p $R $W/k && cp -r . $W/k/ 2>/dev/null; rm -rf $W/k/dist
    nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/device.txt
    (cd $W/k && cmake -S cuda -B $W/bk -DCMAKE_BUILD_TYPE=Release > /dev/null &&
        timeout 300 cmake --build $W/bk -j "$(nproc)" --target test_cuda_kernels bench_gdn_cuda 2>&1 |
        grep -E "error|warning"; echo "build done")
    timeout 60 $W/bk/test_cuda_kernels --only gdn 2>&1 | tee $R/test_gdn.log | grep -v "^ok" | tail -12
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $CALLER/dist/q/*.whl && export PYTHONPATH=/tmp/site
    mkdir -p $R/gdnbench $R/gdnbench3
    { timeout 60 $W/bk/bench_gdn_cuda $R/gdnbench --lengths 8192,1024,4096,32768 &&
      timeout 60 $W/bk/bench_gdn_cuda $R/gdnbench3 --lengths 8192,1024,4096,32768 --heads 3 --kv-heads 3 ; } 2>&1 |
        tee $R/bench_gdn.txt
    timeout 150 python3 scripts/bench-gdn-fla.py $R/gdnbench --lengths 1024,4096,8192,32768 2>&1 | grep -v "^ *$" |
        tail -12 | tee $R/fla.txt
    cp $R/test_gdn.log $R/bench_gdn.txt $R/fla.txt $R/device.txt $OUT/
    timeout 200 $W/bk/test_cuda_kernels > $R/test_cuda_kernels.log 2>&1
    echo "test_cuda_kernels exit $?"; grep -v "^PASS\|^ok" $R/test_cuda_kernels.log | tail -8
    cp $R/test_cuda_kernels.log $OUT/
    ;;
esac
