#!/usr/bin/env bash
# Install the package (not the test extra), then run the quickstart: a tiny Llama learns string transforms on 2 CPU
# ranks (~1 min).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh none
exec "${PYTHON:-python3}" -m finetune.launch +recipe=quickstart_sft "$@"
