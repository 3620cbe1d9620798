#!/usr/bin/env bash
# Install, then run the whole test suite on CPU (GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two workers (pytest-xdist), a test file per worker: the machines this runs on have 2 cores, and much of a CLI test is
# process start-up and waiting. The workers share the cores (tests/ranks.py): a job of two ranks waits for the other
# worker's test, so no more training processes run than there are cores. FINETUNE_TEST_WORKERS=0 runs in one process.
# The longest files run first (tests/conftest.py's order, which --no-loadscope-reorder keeps). The JUnit report of the
# run, test-results/last.xml, is what `python scripts/slowest.py` reads: the slowest files and tests.
exec "${PYTHON:-python3}" -m pytest -q -n "${FINETUNE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 \
  --junitxml=test-results/last.xml "$@"
