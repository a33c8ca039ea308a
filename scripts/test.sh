#!/usr/bin/env bash
# One command from a clean clone: set everything up, lint, type-check, build the docs (--strict:
# a broken link or a missing page fails) and run the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
"$ROOT/scripts/services.sh"
cd "$ROOT"
mkdir -p build
# What only the tests need is made in the background, beside the checks below (mypy and the
# docs build use one core; these mostly wait on downloads and the disk), and waited for before
# pytest: the bytecode of everything installed (setup.sh: the suite starts hundreds of
# processes), the MLflow server's virtualenv, and mergekit 0.1.5 for the parity tests
# (bench/setup.sh). A failure of any of them stops the run there.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a check failed: nothing left running
LAYERSWAP_COMPILE_BYTECODE=1 bash scripts/setup.sh &
setups=($!)
scripts/setup_mlflow.sh &
setups+=($!)
bash bench/setup.sh &
setups+=($!)
# The Docker tests (tests/docker: docker-compose.yml, run) need an engine; without one they skip.
# Their images build in the background too (scripts/docker_images.sh); the tests' own build
# then comes from Docker's cache, and says why where this one failed.
images=""
if scripts/docker.sh; then
    scripts/docker_images.sh >build/docker-images.log 2>&1 &
    images=$!
else
    echo "== no Docker engine: tests/docker will be skipped"
fi
# One command per line: under `set -e` a failure inside an `a && b` list would not stop the script.
# Each step says when it started (seconds since this script did): where CI's time goes.
step() { echo "== $1 (at ${SECONDS} s)"; }
step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
step "mypy"
.venv/bin/mypy
step "import-linter (pyproject.toml: the direction of dependency, no cycles)"
.venv/bin/lint-imports
step "code shape (scripts/check_code.py: function lengths, deferred imports)"
.venv/bin/python scripts/check_code.py
step "docs"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
step "waiting for the set-up in the background (bytecode, MLflow, mergekit, Docker images)"
for setup in "${setups[@]}"; do
    wait "$setup"
done
if [[ -n "$images" ]] && ! wait "$images"; then
    echo "== the Docker images did not build (build/docker-images.log): tests/docker will say why"
fi
step "pytest"
# The console tests save a screenshot of each page here (a test artifact CI can keep).
export CONSOLE_SCREENSHOTS="${CONSOLE_SCREENSHOTS:-$ROOT/build/screenshots}"
# Several workers (pytest-xdist), twice the cores: many tests spend their time waiting on
# other processes (servers, Celery workers, containers, CLIs). Each module runs whole on one
# worker (--dist loadfile; tests/conftest.py hands out the console's modules, which share a
# costly session fixture, as one): its module-scoped fixtures are made once and its steps keep
# their order; modules are handed out in the order collected (tests/conftest.py puts the
# longest first). The slowest tests are listed at the end: where the suite's time goes.
.venv/bin/python -m pytest -n "${LAYERSWAP_TEST_WORKERS:-4}" --dist loadfile \
    --no-loadscope-reorder --durations=30 "$@"
