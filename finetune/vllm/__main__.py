"""`python -m finetune.vllm`: the vLLM server (finetune.vllm.server)."""

from finetune.vllm.server import main

if __name__ == "__main__":
    main()
