#!/usr/bin/env bash
# Make sure the local PostgreSQL (127.0.0.1:5432, trust auth) and Redis the tests use are running
# (and that Chromium, which the console tests drive, is installed);
# start it, or install it from Debian's packages, when it is not.
set -euo pipefail

pg_ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "services: installing PostgreSQL" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
if ! pg_ready; then
    echo "services: starting PostgreSQL" >&2
    version="$(ls /etc/postgresql | sort -V | tail -n 1)"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 30); do pg_ready && break; sleep 1; done
fi
pg_ready || { echo "services: PostgreSQL is not reachable on 127.0.0.1:5432" >&2; exit 1; }

# Redis: the distributed tests start private redis-server processes (so they can stop them);
# the machine's own on 127.0.0.1:6379 serves `LAYERSWAP_EXECUTOR=celery` by default.
redis_ready() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! command -v redis-server >/dev/null 2>&1; then
    echo "services: installing Redis" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if ! redis_ready; then
    echo "services: starting Redis" >&2
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
    for _ in $(seq 1 30); do redis_ready && break; sleep 1; done
fi
redis_ready || { echo "services: Redis is not reachable on 127.0.0.1:6379" >&2; exit 1; }

# Chromium and its WebDriver: the web console's tests (tests/console) drive them headless.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    echo "services: installing chromium and chromium-driver" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
