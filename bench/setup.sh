#!/usr/bin/env bash
# Idempotent set-up of the benchmark's own virtualenv (.venv-bench) holding mergekit.
#
# mergekit lives apart from the project's .venv so that its dependency pins (transformers 5,
# accelerate, peft, datasets, ...) never touch the project. torch is pinned in the same
# resolution, to the same CPU build the project uses; mergekit's own requirement (torch>=2.0.0)
# is then satisfied by it, so no other torch and no CUDA packages come in. The layerswap side of the
# benchmark runs from the project's .venv (scripts/setup.sh makes it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-bench"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

TORCH_SPEC="${BENCH_TORCH_SPEC:-torch==2.13.0}"
MERGEKIT_SPEC="${BENCH_MERGEKIT_SPEC:-mergekit==0.1.5}"

stamp="$VENV/.bench-setup"
want="$(sha256sum "$ROOT/bench/setup.sh" | cut -d' ' -f1) $TORCH_SPEC $MERGEKIT_SPEC"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "bench/setup.sh: $VENV is up to date ($MERGEKIT_SPEC, $TORCH_SPEC)" >&2
    exit 0
fi

echo "bench/setup.sh: creating $VENV" >&2
# With the project's uv (scripts/setup.sh installs it) and the machine's pip configuration
# given to it; bytecode compiled, since the parity tests start mergekit again and again.
[[ -x "$ROOT/.venv/bin/uv" ]] || bash "$ROOT/scripts/setup.sh"
eval "$("$ROOT/.venv/bin/python" "$ROOT/scripts/uv_env.py")"
[[ -x "$VENV/bin/python" ]] || "$ROOT/.venv/bin/uv" venv -q --python "$PYTHON" "$VENV"
"$ROOT/.venv/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" \
    "$TORCH_SPEC" "$MERGEKIT_SPEC"

# Refuse a set-up in which resolving mergekit replaced torch or brought in CUDA wheels.
"$VENV/bin/python" - "$TORCH_SPEC" <<'PY'
import importlib.metadata as md
import sys

want = sys.argv[1].split("==", 1)[1]
torch_version = md.version("torch")
if torch_version.split("+", 1)[0] != want:
    sys.exit(f"bench/setup.sh: torch is {torch_version}, expected {want}")
cuda = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("nvidia-"))
if cuda:
    sys.exit(f"bench/setup.sh: CUDA packages were pulled in: {', '.join(cuda)}")
print(f"bench/setup.sh: mergekit {md.version('mergekit')}, torch {torch_version}", file=sys.stderr)
PY
"$VENV/bin/mergekit-yaml" --help >/dev/null
echo "$want" >"$stamp"
