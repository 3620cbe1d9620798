"""vLLM as this project drives it: the engine both sampling modes build (engine.py), and the server that samples on
devices of its own for a run (`python -m finetune.vllm`: server.py) with what run and server say to each other
(wire.py). It imports nothing of finetune outside this package and no torch at import: the server runs in vLLM's own
virtualenv, where `pip install --no-deps finetune` brings it."""
