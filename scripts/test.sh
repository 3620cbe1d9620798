#!/usr/bin/env bash
# Install, then run the whole test suite on CPU (GPU-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
# Python's default for the run: each module byte-compiled when first imported, once for every later process. Where
# PYTHONDONTWRITEBYTECODE is set (these machines set it), every process would compile every module it imports anew,
# and install.sh would compile the whole environment first (22,000 files, 70 CPU-s) where the suite imports a part.
unset PYTHONDONTWRITEBYTECODE
bash scripts/install.sh test
# Two workers (pytest-xdist) on the two cores these machines have; much of a CLI test is process start-up and waiting.
# --dist loadfile: the files whose tests are mostly jobs of two ranks run on one worker, one after another, every other
# file on either (tests/conftest.py's RANKS and order, which --no-loadscope-reorder keeps), and tests/ranks.py's locks
# keep two jobs of two ranks from ever running at once. FINETUNE_TEST_WORKERS=0 runs in one process. The JUnit report of
# the run, test-results/last.xml, is what `python scripts/slowest.py` reads: the slowest files and tests.
# FINETUNE_TEST_PREBUILD=1 (the default for the whole suite, run without arguments): DeepSpeed's JIT ops, where this
# machine has not built them yet, build beside the first tests (tests/build_ops.py), not inside the first DeepSpeed test,
# which holds both cores while one of them compiles. A run of a selection builds an op only when one of its tests needs it.
PREBUILD=${FINETUNE_TEST_PREBUILD:-$([ $# -eq 0 ] && echo 1 || echo 0)}
FINETUNE_TEST_PREBUILD=$PREBUILD exec "${PYTHON:-python3}" -m pytest -q -n "${FINETUNE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 \
  --junitxml=test-results/last.xml "$@"
