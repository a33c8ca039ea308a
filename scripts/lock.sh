#!/usr/bin/env bash
# Regenerate constraints.txt, the versions scripts/setup.sh (and the Dockerfile) install, with
# `uv pip compile`: every dependency of the project with all its extras and of the client, torch
# left out (pinned on its own: LAYERSWAP_TORCH_SPEC). Versions already in constraints.txt are
# kept unless they no longer fit; pass --upgrade, or --upgrade-package NAME, to move them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UV="$ROOT/.venv/bin/uv"
[[ -x "$UV" ]] || { echo "lock: no $UV; run scripts/setup.sh first" >&2; exit 1; }
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
TORCH_SPEC="${LAYERSWAP_TORCH_SPEC:-torch==2.13.0}"
eval "$("$PYTHON" "$ROOT/scripts/uv_env.py")"
cd "$ROOT"
printf -- '-e ./client\n-e .[dev]\n%s\n' "$TORCH_SPEC" |
    "$UV" pip compile - --output-file constraints.txt --python "$ROOT/.venv/bin/python" \
        --no-emit-package torch --no-emit-package layerswap --no-emit-package layerswap-client \
        --custom-compile-command scripts/lock.sh --quiet "$@"
