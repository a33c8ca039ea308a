#!/usr/bin/env bash
# Seconds from `git clone` to the first succeeded job with ./scripts/run.sh, as a newcomer gets
# them: clone, set-up (scripts/setup.sh), example checkpoints, the API up, a layer swap submitted
# with curl and followed until it succeeds. Not part of the test suite.
#
#   bench/fresh_clone.sh [REPOSITORY]          # default: this checkout's committed HEAD
#   UV_CACHE_DIR=$(mktemp -d) bench/fresh_clone.sh   # a cold uv cache (nothing downloaded yet)
set -euo pipefail
SOURCE="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
WORK="$(mktemp -d)"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

start="$(now)"
git clone -q "$SOURCE" "$WORK/clone"
cd "$WORK/clone"
./scripts/run.sh --port "$PORT" >"$WORK/run.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
until curl -sf "$URL/healthz" >/dev/null; do
    kill -0 "$server" 2>/dev/null || { cat "$WORK/run.log" >&2; exit 1; }
    sleep 0.2
done
serving="$(since "$start")"
JOB=$(curl -s -X POST "$URL/v1/merges" -H 'Content-Type: application/json' \
  -d '{"method": "layer_swap", "experts": {"task": ["examples/math"], "language": ["examples/swh"]},
       "params": {"bottom": 1, "top": 1}}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
until curl -s "$URL/v1/merges/$JOB" | grep -Eq '"status":"(succeeded|failed|canceled)"'; do sleep 0.2; done
curl -s "$URL/v1/merges/$JOB" | grep -q '"status":"succeeded"' || { echo "the job did not succeed" >&2; exit 1; }
echo "clone to API up: ${serving} s; clone to first succeeded job: $(since "$start") s ($WORK)"
