build-cpu/still bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 32 -d 32768 -r 1 -t 2 --attn lolcats --no-warmup --csv
