#!/usr/bin/env bash
# One command from a clean clone: set everything up, then run the Layerswap service on its
# embedded default (SQLite + in-process executor, data under ./data) on http://127.0.0.1:8000
# (another port: --port N or LAYERSWAP_PORT=N; the arguments are `layerswap serve`'s).
# Example checkpoints (and a few MGSM-format rows) are created once under
# data/checkpoints/examples to try the API with.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# Bytecode, as test.sh makes it: uv leaves compiling to the first import, which cannot cache it
# where PYTHONDONTWRITEBYTECODE is set, so every start would compile torch and transformers
# again. Everything installed is compiled once (setup.sh keeps a stamp), then the project's own
# modules (an editable install; only changed files again): in the background at the lowest
# priority, since compiling all of it takes longer than the first start's imports do.
(
    LAYERSWAP_COMPILE_BYTECODE=1 nice -n 19 bash scripts/setup.sh
    nice -n 19 .venv/bin/python -m compileall -q -j 0 core engine layerswap service worker \
        client/layerswap_client >/dev/null
) &
export LAYERSWAP_DATA_DIR="${LAYERSWAP_DATA_DIR:-$ROOT/data}"
EXAMPLES="$LAYERSWAP_DATA_DIR/checkpoints/examples"
[[ -d "$EXAMPLES/eval-data" ]] || .venv/bin/layerswap examples "$EXAMPLES"
# Evaluation data: a few MGSM-format rows from `layerswap examples` unless set (real MGSM:
# scripts/export_mgsm.py).
export LAYERSWAP_EVAL_DATA_DIR="${LAYERSWAP_EVAL_DATA_DIR:-$EXAMPLES/eval-data}"
# Webhooks to a receiver on this machine (local development only; deployments reach public
# addresses unless they allow networks).
export LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS="${LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS:-[\"127.0.0.0/8\"]}"
exec .venv/bin/layerswap serve "$@"
