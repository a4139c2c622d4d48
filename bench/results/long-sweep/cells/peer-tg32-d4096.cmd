peer/llama-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 0 -n 32 -d 4096 -fa on -t 2 -r 1 -o csv
