#!/usr/bin/env bash
# Build the stand-in images deploy/compose.test.yml names (no image registry is reachable where
# the tests run): a Debian bookworm base made with debootstrap (only when missing: it is the slow
# step), then python, python-build, postgres and redis images from Debian's packages.
# python-build, the test images' base, gets this machine's pip CA bundle and torch's CPU wheel
# from pip's find-links folder (`pip config list`); the production files never name either.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
MINBASE=layerswap-test/bookworm:minbase
TORCH_WHEEL_VERSION="${TORCH_WHEEL_VERSION:-2.13.0+cpu}"

if ! docker image inspect "$MINBASE" >/dev/null 2>&1; then
    echo "standins: debootstrap bookworm (minbase)" >&2
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import - "$MINBASE" >/dev/null
fi

pip_option() {  # the value pip's configuration gives an option (e.g. cert), or nothing
    "$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | head -n 1
}

context="$(mktemp -d)"
trap 'rm -rf "$context" ${root:+"$root"}' EXIT
cert="$(pip_option cert)"
cp "${cert:-/etc/ssl/certs/ca-certificates.crt}" "$context/ca-bundle.crt"
mkdir "$context/wheels"
for folder in $(pip_option find-links); do
    cp "$folder"/torch-"$TORCH_WHEEL_VERSION"-*.whl "$context/wheels/" 2>/dev/null || true
done
cp "$HERE/python/build.Dockerfile" "$context/Dockerfile"

# Side by side (apt downloads overlap), then the one that builds on python.
build() { docker build -q -t "$1" "$2" >/dev/null; }
build layerswap-test/postgres:15 "$HERE/postgres" & postgres=$!
build layerswap-test/redis:7 "$HERE/redis" & redis=$!
build layerswap-test/python:3.11 "$HERE/python"
build layerswap-test/python-build:3.11 "$context"
wait "$postgres"
wait "$redis"
echo "standins: built" >&2
