#!/usr/bin/env bash
# The MLflow tracking server the test suite starts (tests/integrations): its own virtualenv,
# since MLflow's server pins pyarrow below the version the service's eval extra uses. The
# service itself needs only the client (mlflow-skinny, in .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-mlflow"
SPEC="mlflow==3.17.2"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [[ ! -f "$VENV/.layerswap-setup" || "$(cat "$VENV/.layerswap-setup")" != "$SPEC" ]]; then
    echo "setup: MLflow server virtualenv in $VENV" >&2
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "$SPEC"
    echo "$SPEC" >"$VENV/.layerswap-setup"
fi
