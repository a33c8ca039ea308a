#!/usr/bin/env bash
# Seconds of ./scripts/test.sh's set-up in a fresh clone: the project's virtualenv (with its
# bytecode, as test.sh asks), the local services, the MLflow server's and mergekit's
# virtualenvs; not the checks and tests that follow. Not part of the test suite.
#
#   bench/setup_time.sh [REPOSITORY]          # default: this checkout's committed HEAD
set -euo pipefail
SOURCE="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
WORK="$(mktemp -d)"
git clone -q "$SOURCE" "$WORK/clone"
cd "$WORK/clone"
step() {
    local start end
    start="$(date +%s.%N)"
    "$@" >>"$WORK/setup.log" 2>&1
    end="$(date +%s.%N)"
    python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):6.1f} s  {sys.argv[3]}')" "$start" "$end" "$*"
}
step env LAYERSWAP_COMPILE_BYTECODE=1 bash scripts/setup.sh
step scripts/services.sh
step scripts/setup_mlflow.sh
step bash bench/setup.sh
echo "($WORK)"
