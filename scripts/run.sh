#!/usr/bin/env bash
# One command from a clean clone: set everything up, then run the Layerswap service on its
# embedded default (SQLite + in-process executor, data under ./data) on http://127.0.0.1:8000.
# Example checkpoints (and a few MGSM-format rows) are created once under
# data/checkpoints/examples to try the API with.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
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
