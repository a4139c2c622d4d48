build-cpu/still bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf --adapter adapters/smollm2-135m-still.gguf --sel-cache q8 -p 0 -n 256 -d 1024,16384,65536 --interleave -r 2 --no-warmup -t 2 --csv
