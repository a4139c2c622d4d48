peer/peer-prefill-decode models/SmolLM2-135M-Instruct.Q4_1.gguf 32768 32 2   # one process for peer-pp32768 and peer-tg32-d32768
