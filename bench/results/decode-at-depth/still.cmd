build-cpu/still bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 256 -d 1024,16384,32768,65536 --interleave -r 2 --no-warmup -t 2 --attn still --csv
