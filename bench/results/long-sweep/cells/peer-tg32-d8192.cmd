peer/llama-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 32 -d 8192 -fa on -t 2 -r 1 --no-warmup -o csv
