#!/usr/bin/env bash
# Install finetune (editable) with its test extra into the current Python.
# On a machine without an NVIDIA GPU, torch's CPU build is installed first: a plain `torch`
# requirement would otherwise pull multi-GB CUDA wheels. On GPU machines pip picks CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
