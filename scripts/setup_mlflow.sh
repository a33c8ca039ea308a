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
    # With the project's uv (scripts/setup.sh installs it), given the machine's pip configuration.
    [[ -x "$ROOT/.venv/bin/uv" ]] || bash "$ROOT/scripts/setup.sh"
    eval "$("$ROOT/.venv/bin/python" "$ROOT/scripts/uv_env.py")"
    [[ -x "$VENV/bin/python" ]] || "$ROOT/.venv/bin/uv" venv -q --python "$PYTHON" "$VENV"
    "$ROOT/.venv/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" "$SPEC"
    echo "$SPEC" >"$VENV/.layerswap-setup"
fi
