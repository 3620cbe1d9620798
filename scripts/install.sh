#!/usr/bin/env bash
# Install finetune (editable) into the current Python, at the versions the suite is tested with (constraints/test.txt,
# refreshed on purpose by scripts/lock.sh; pyproject.toml's ranges stay open for users):
#   bash scripts/install.sh          # with the test extra (trackers, lm-eval, GGUF, Optuna, docs): what scripts/test.sh runs
#   bash scripts/install.sh none     # the package alone: what scripts/quickstart.sh needs
#   bash scripts/install.sh gpu      # any extras of pyproject.toml, comma-separated
# Without torch and without an NVIDIA GPU, torch is installed first, from pip's configured index
# (on Linux, PyPI's torch wheel is the CUDA build). For the CPU build, name PyTorch's CPU index:
#   FINETUNE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install.sh
# On GPU machines pip picks CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip byte-compiles every module it installs, one after another (torch's thousands among them): 52 of the 88 s a fresh
# install of the package took here. So it installs them uncompiled, and then either Python compiles the ones a run
# imports when it first imports them, or, where it writes no bytecode (PYTHONDONTWRITEBYTECODE set, as on these
# machines: every process would compile every module it imports anew, again and again), compileall compiles the
# environment once, on every core.
EXTRAS=${1:-test}
if ! "$PY" -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
  if [ -n "${FINETUNE_TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install -q --no-compile -c constraints/test.txt torch --index-url "$FINETUNE_TORCH_INDEX_URL"
  else
    "$PY" -m pip install -q --no-compile -c constraints/test.txt torch
  fi
fi
if [ "$EXTRAS" = none ]; then
  "$PY" -m pip install -q --no-compile -c constraints/test.txt -e .
else
  "$PY" -m pip install -q --no-compile -c constraints/test.txt -e ".[$EXTRAS]"
fi
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  # a file some package ships for another Python version does not compile: pip skips it too
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
  # and this checkout's own modules (the editable install imports them from here): 0.15 s of each rank's start-up
  "$PY" -m compileall -q -j 0 -x '/assets/' finetune > /dev/null || true
fi
