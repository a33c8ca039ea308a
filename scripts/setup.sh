#!/usr/bin/env bash
# Idempotent set-up from a clean clone: virtualenv, torch pinned, the project, local services.
# Sourced by run.sh and test.sh; safe to run on its own.
#
# Installs with uv (pinned below, put into the virtualenv with pip when it is not there), at the
# versions in constraints.txt. uv does not read pip's configuration: scripts/uv_env.py turns it
# into UV_* variables (a local wheel folder, mirrors, a CA bundle), unless those are set already.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

# torch pinned, in the same resolution as the rest: 2.13.0 is a local CPU wheel here; an unpinned
# torch pulls GBs of CUDA.
TORCH_SPEC="${LAYERSWAP_TORCH_SPEC:-torch==2.13.0}"
UV_VERSION="0.13.9"  # the dev extra pins the same

stamp="$VENV/.layerswap-setup"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/client/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/scripts/setup.sh" "$ROOT/scripts/uv_env.py" | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "setup: installing into $VENV with uv $UV_VERSION" >&2
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv --without-pip "$VENV"
    # pip installs uv, and its configuration is what uv is given: the interpreter's pip, else
    # (none beside it) the virtualenv's own from ensurepip.
    pip=("$PYTHON" -m pip --python "$VENV/bin/python")
    if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$VENV/bin/python" -m ensurepip >/dev/null
        pip=("$VENV/bin/python" -m pip)
    fi
    if [[ "$("$VENV/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
        "${pip[@]}" install -q "uv==$UV_VERSION"
    fi
    eval "$("${pip[0]}" "$ROOT/scripts/uv_env.py")"
    # pip too, for habits (`.venv/bin/pip`) and tools that call it.
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$ROOT/constraints.txt" \
        "$TORCH_SPEC" pip -e "$ROOT/client" -e "$ROOT[dev]"
    echo "$want" >"$stamp"
fi

# Bytecode of everything installed, when asked (test.sh does: the suite starts hundreds of
# processes). pip compiled it at install; uv leaves it to the first import, which cannot cache
# it where PYTHONDONTWRITEBYTECODE is set: every process would compile torch and transformers
# again, seconds each. A module that does not compile (some packages ship such test files) is
# not an error here.
bytecode="$VENV/.layerswap-bytecode"
if [[ "${LAYERSWAP_COMPILE_BYTECODE:-0}" == 1 && "$(cat "$bytecode" 2>/dev/null)" != "$want" ]]; then
    echo "setup: compiling bytecode in $VENV" >&2
    "$VENV/bin/python" -m compileall -q -j 0 "$VENV"/lib/python3*/site-packages >/dev/null || true
    echo "$want" >"$bytecode"
fi
