peer/llama-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 1024 -n 0 -d 0 -fa on -t 2 -r 1 -o csv
