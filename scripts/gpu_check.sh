#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, one command: every GPU-marked test, then the benchmark at a 1B-class
# Llama shape (random init, bf16, packed 2,048-token rows) for the strategies that matter on a GPU.
# Writes OUT_DIR/{device.txt,tests.txt,benchmark.md,varlen.md,peers.md,peers_compiled.md} (default gpu_check/) and prints them.
#   bash scripts/gpu_check.sh [OUT_DIR]
# Needs the gpu extra for the flash-attn, fused-kernel, Liger and FP8 (torchao) rows: pip install -e ".[test,gpu]".
# GRPO's vLLM tests (tests/test_grpo.py: colocated, and `python -m finetune.vllm` on the GPU sampling for a run)
# run where vLLM is installed (pip install vllm: it brings the torch it was built for, so install it in an environment
# of its own); without it they are skipped and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check}
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "error: scripts/gpu_check.sh needs an NVIDIA GPU (nvidia-smi found none); on CPU run bash scripts/test.sh" >&2
  exit 2
fi
mkdir -p "$OUT"
{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT/device.txt"
# 1. Every GPU-marked test (on CPU they are skipped; here they run).
set +e
"$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.txt"
tests=${PIPESTATUS[0]}
set -e
# 2. The benchmark at Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 kv heads, MLP 8192, 128k vocabulary).
#    "FSDP2 bf16 policy x1" beside "bf16 autocast": FSDP2's bf16 MixedPrecisionPolicy (no autocast) against autocast over
#    fp32 weights, tokens/s and MFU on one GPU (the halved all-gather bytes need two: tests/test_fsdp_precision.py counts them).
LLAMA_1B=(model.init.hidden_size=2048 model.init.num_hidden_layers=16 model.init.num_attention_heads=32
          model.init.num_key_value_heads=8 model.init.intermediate_size=8192 model.init.vocab_size=128256
          model.init.max_position_embeddings=4096 data.max_length=2048 data.packing=true
          train.micro_batch_size=4 train.global_batch_size=4 train.device=cuda hardware=h100_80g)
"$PY" scripts/benchmark.py --steps 30 --out "$OUT/benchmark.md" --dry-runs 0 \
  --only "bf16 autocast" "bf16 + compile" "bf16 + compile + Liger" "fp8 tensorwise + compile" "fp8 rowwise + compile" "full checkpointing" "op-level checkpointing" "FSDP2 bf16 policy x1" "LoRA r=16" "QLoRA r=16 (NF4)" --extra "${LLAMA_1B[@]}"
cat "$OUT/benchmark.md"
# 3. Rows of several samples at 1k, 4k and 8k tokens: transformers' mask against attention per sample (sdpa) and
#    flash-attn's variable-length kernel, at the 1B shape's width (4 layers).
"$PY" scripts/benchmark_varlen.py --device cuda --dtype bf16 --kernels sdpa flash_attention_2 --hidden 2048 --layers 4 \
  | tee "$OUT/varlen.md"
# 4. The same 1B-class SFT job through ours, transformers' Trainer and TRL on this GPU (bf16, flash-attn; padded and
#    packed), then ours compiled with Liger's kernels beside the Trainer. Needs the bench extra (TRL).
PEERS=(--device cuda --precision bf16 --attn flash_attention_2 --hidden 2048 --layers 16 --heads 32 --vocab 128256
       --max-length 2048 --micro-batch 4 --accum 1 --steps 30 --repeats 1 --threads 8)
"$PY" scripts/benchmark_peers.py "${PEERS[@]}" --ours-extra hardware=h100_80g --out "$OUT/peers.md"
"$PY" scripts/benchmark_peers.py "${PEERS[@]}" --peers hf --no-ours-padded --out "$OUT/peers_compiled.md" \
  --ours-extra hardware=h100_80g train.compile=true model.kernels=liger logits=chunked logits.kernel=liger
# 5. GRPO's rollout against model.generate with its KV cache on the same batch (issue 32's goal: as fast per token).
#    With vLLM installed, its rollout (method.vllm) is a third row.
VLLM_ROW=$("$PY" -c "import vllm" >/dev/null 2>&1 && echo --vllm || true)
"$PY" scripts/benchmark_rollout.py --device cuda --dtype bf16 --hidden 2048 --layers 16 --prompts 16 --generations 8 \
  --prompt-tokens 256 --new-tokens 256 $VLLM_ROW | tee "$OUT/rollout.md"
exit "$tests"
