#!/usr/bin/env bash
# Idempotent set-up from a clean clone: virtualenv, torch pinned first, the project, local services.
# Sourced by run.sh and test.sh; safe to run on its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

# torch first and pinned: 2.13.0 is a local CPU wheel here; an unpinned torch pulls GBs of CUDA.
TORCH_SPEC="${LAYERSWAP_TORCH_SPEC:-torch==2.13.0}"

stamp="$VENV/.layerswap-setup"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/client/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "setup: creating virtualenv in $VENV" >&2
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT/client"
    "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT[dev,eval]"
    echo "$want" >"$stamp"
fi
