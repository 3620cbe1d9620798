#!/usr/bin/env bash
# Refresh constraints/test.txt on purpose: a new virtualenv gets the newest releases that .[test] allows (torch pinned
# to the tested build), and pip freeze writes them down with the date and the machine they were resolved on.
# scripts/install.sh installs under these constraints, so every machine tests the same versions until this runs again;
# the runtime ranges in pyproject.toml stay open for users. After a refresh, run bash scripts/test.sh and commit both.
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' constraints/test.txt 2>/dev/null || true)
TORCH=${TORCH:-2.13.0}
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$TORCH"
"$venv/bin/python" -m pip install -q ".[test]"
{
  echo "# The versions the suite is tested with: pip constraints for scripts/install.sh (pip install -c constraints/test.txt)."
  echo "# Made by scripts/lock.sh on $(date -u +%Y-%m-%d) from a new virtualenv: $("$venv/bin/python" -c 'import platform, sys; print(f"Python {platform.python_version()}, {sys.platform} {platform.machine()}")'), pip $("$venv/bin/python" -m pip --version | cut -d' ' -f2)."
  echo "# Refresh on purpose (bash scripts/lock.sh), then run the suite; never edit by hand. torch's local tag (+cpu) is dropped:"
  echo "# the same release is the CUDA build on a GPU machine. A package absent here (a GPU extra's, another platform's) is free."
  "$venv/bin/python" -m pip freeze --all --exclude pip --exclude-editable | grep -v -i '^finetune[= @]' | sed 's/^torch==\([0-9.]*\)+[a-z0-9]*$/torch==\1/'
} > constraints/test.txt.new
mv constraints/test.txt.new constraints/test.txt
echo "constraints/test.txt: $(grep -vc '^#' constraints/test.txt) packages"
