#!/usr/bin/env bash
# Make sure a Docker engine runs for tests/docker (docker-compose.yml, run): install Debian's
# docker.io, its docker-compose (where `docker compose` is missing) and debootstrap (the stand-in
# images' base) when missing, and start dockerd when it is not running, as services.sh does for
# PostgreSQL and Redis. Exits non-zero where no engine can run (no root, no kernel support):
# scripts/test.sh then runs the suite without the Docker tests.
set -euo pipefail

docker_ready() { docker info >/dev/null 2>&1; }
has_compose() { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1 \
    || ! command -v docker >/dev/null 2>&1 || ! has_compose; then
    echo "docker: installing docker.io, docker-compose and debootstrap" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io docker-compose debootstrap >/dev/null
fi
if ! docker_ready; then
    echo "docker: starting dockerd" >&2
    setsid dockerd >/var/log/dockerd.log 2>&1 </dev/null &
    for _ in $(seq 1 30); do docker_ready && break; sleep 1; done
fi
docker_ready || { echo "docker: no Docker engine answers (/var/log/dockerd.log)" >&2; exit 1; }
