#!/usr/bin/env bash
# Install, then run the whole test suite on CPU (GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two workers (pytest-xdist), a test file per worker: the machines this runs on have 2 cores, and much
# of a CLI test is process start-up and waiting; FINETUNE_TEST_WORKERS=0 runs in one process. The longest files run
# first (tests/conftest.py's order, which --no-loadscope-reorder keeps), so both workers end at about the same time.
exec "${PYTHON:-python3}" -m pytest -q -n "${FINETUNE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 "$@"
