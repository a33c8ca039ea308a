#!/usr/bin/env bash
# The Docker Compose deployment, measured: image builds (cold, and after a code-only change),
# image sizes, and the whole tests/docker module (which times `up -d` to the first succeeded
# job). Needs a Docker engine (scripts/docker.sh) and the project's .venv.
#   bash bench/compose.sh          # warm: images and build cache as they are
#   bash bench/compose.sh --cold   # first removes this project's images and the build cache
# Prints a Markdown report; the figures in docs/deployment.md come from it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
COMPOSE=(docker compose)
docker compose version >/dev/null 2>&1 || COMPOSE=(docker-compose)
FILES=(-f docker-compose.yml -f deploy/compose.test.yml --profile cpu)
export FLOWER_BASIC_AUTH=bench:bench
ARGS=(--build-arg BASE_IMAGE=layerswap-test/python-build:3.11
      --build-arg TORCH_SPEC=torch==2.13.0+cpu)

seconds() { local t0=$SECONDS; "$@" >/dev/null 2>&1; echo $((SECONDS - t0)); }
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.2f GB", $1 / 1e9}'; }

MODE=warm
if [[ "${1:-}" == "--cold" ]]; then
    MODE="cold: no image, no build cache"
    docker image rm -f layerswap:latest layerswap-api:latest layerswap-test/python:3.11 \
        layerswap-test/python-build:3.11 layerswap-test/postgres:15 layerswap-test/redis:7 \
        layerswap-test/bookworm:minbase >/dev/null 2>&1 || true
    docker builder prune -af >/dev/null
fi

# The module builds what is missing (stand-ins, images), deploys and runs every step.
start=$SECONDS
"$PY" -m pytest -q -p no:cacheprovider -s tests/docker/test_compose.py >/tmp/compose-bench.log 2>&1 \
    || { tail -30 /tmp/compose-bench.log; exit 1; }
module=$((SECONDS - start))
timings=$(grep -o "compose timings: .*" /tmp/compose-bench.log)
probe=layerswap/__init__.py  # a code-only change: one comment line, removed again
cp "$probe" /tmp/layerswap-probe.py
echo "# rebuild probe $RANDOM" >>"$probe"
rebuild=$(seconds "${COMPOSE[@]}" "${FILES[@]}" build worker-cpu)
cp /tmp/layerswap-probe.py "$probe"
"${COMPOSE[@]}" "${FILES[@]}" build worker-cpu >/dev/null 2>&1  # back to the checkout's image
api=$(seconds docker build "${ARGS[@]}" --target api -t layerswap-api:latest .)

cat <<REPORT
| step | seconds |
|---|---:|
| tests/docker/test_compose.py, end to end ($MODE) | $module |
| rebuild of the image after a code-only change | $rebuild |
| the api target, after the worker one | $api |

images: layerswap (worker) $(size layerswap:latest), layerswap-api $(size layerswap-api:latest)
$timings (seconds; up_to_first_job_s: from \`up -d\` to the first merge succeeded)
REPORT
