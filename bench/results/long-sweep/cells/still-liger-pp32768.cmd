build-cpu/still bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 32768 -n 0 -d 0 -r 1 -t 2 --attn liger --no-warmup --csv
