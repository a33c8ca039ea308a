#!/usr/bin/env bash
# Build the images the Docker tests (tests/docker) run: the stand-ins (deploy/test), then
# docker-compose.yml's own build with deploy/compose.test.yml, the commands the tests' fixture
# runs. scripts/test.sh starts this in the background while the checks before pytest run (mostly
# one core, and the build mostly waits on downloads); the tests then build again, from Docker's
# cache.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}" bash deploy/test/build-standins.sh
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
# The file insists on FLOWER_BASIC_AUTH being set, even to build: a value no container keeps.
FLOWER_BASIC_AUTH=build:unused "${compose[@]}" -p layerswap-images -f docker-compose.yml \
    -f deploy/compose.test.yml --profile cpu build -q
echo "docker_images: built" >&2
