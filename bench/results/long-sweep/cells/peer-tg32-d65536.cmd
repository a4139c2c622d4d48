peer/peer-prefill-decode models/SmolLM2-135M-Instruct.Q4_1.gguf 65536 32 2   # one process for peer-pp65536 and peer-tg32-d65536
