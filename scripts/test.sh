#!/usr/bin/env bash
# One command from a clean clone: set everything up, lint, type-check, build the docs (--strict:
# a broken link or a missing page fails) and run the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAYERSWAP_COMPILE_BYTECODE=1 source "$ROOT/scripts/setup.sh"
"$ROOT/scripts/services.sh"
# The Docker tests (tests/docker: docker-compose.yml, run) need an engine; without one they skip.
"$ROOT/scripts/docker.sh" || echo "== no Docker engine: tests/docker will be skipped"
"$ROOT/scripts/setup_mlflow.sh"
cd "$ROOT"
# One command per line: under `set -e` a failure inside an `a && b` list would not stop the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
echo "== import-linter (pyproject.toml: the direction of dependency, no cycles)"
.venv/bin/lint-imports
echo "== code shape (scripts/check_code.py: function lengths, deferred imports)"
.venv/bin/python scripts/check_code.py
echo "== docs"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
echo "== mergekit 0.1.5 for the parity tests (bench/setup.sh: idempotent)"
bash "$ROOT/bench/setup.sh"
echo "== pytest"
# The console tests save a screenshot of each page here (a test artifact CI can keep).
export CONSOLE_SCREENSHOTS="${CONSOLE_SCREENSHOTS:-$ROOT/build/screenshots}"
# The slowest tests are listed at the end: where the suite's time goes.
.venv/bin/python -m pytest --durations=30 "$@"
