#!/usr/bin/env bash
# One command from a clean clone: set everything up, then run Layerswap's main job on its
# embedded default — for now the CLI demo: example checkpoints -> plan -> layer swap -> analysis.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
DEMO="${LAYERSWAP_DEMO_DIR:-$ROOT/examples}"
cd "$ROOT"

[[ -d "$DEMO/base" ]] || layerswap examples "$DEMO"
echo "== plan (dry run)"
layerswap merge "$DEMO/layer_swap.yaml" --out "$DEMO/merged" --dry-run
echo "== layer swap"
layerswap merge "$DEMO/layer_swap.yaml" --out "$DEMO/merged" --overwrite
echo "== delta analysis"
layerswap analyze --base "$DEMO/base" --expert "$DEMO/math" --expert "$DEMO/swh" \
    --task math --language swh --out "$DEMO/analysis"
