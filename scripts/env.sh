#!/usr/bin/env bash
# Sourced by scripts/main.sh and scripts/test.sh: creates the virtual environment and installs
# setdiff-dist on first use (CPU torch pinned first, so that no dependency pulls a CUDA build),
# and again only when setup.py changes. Set SETDIFF_VENV to put the environment elsewhere and
# TORCH_VERSION to pin another torch.
set -euo pipefail
SETDIFF_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SETDIFF_VENV:-$SETDIFF_ROOT/.venv}"
TORCH_PIN="torch==${TORCH_VERSION:-2.13.0}"
stamp="$VENV/.setdiff-installed"
PINS="$SETDIFF_ROOT/docker/requirements.txt"  # the exact versions the docker image uses too
want="$(cat "$SETDIFF_ROOT/setup.py" "$PINS" <(echo "$TORCH_PIN") | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setdiff] creating $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[setdiff] installing $TORCH_PIN and setdiff-dist into $VENV (first use: a few minutes)" >&2
    start=$(date +%s)
    pip_install() {  # quiet, minus the noise of this machine's unused local indexes and of
        # setuptools' notices on editable installs (warnings of the build backend's process)
        PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" \
            2> >(grep -v "^WARNING: Location" >&2)
    }
    pip_install --upgrade pip
    pip_install "$TORCH_PIN"
    # torch stays pinned in the same command, or a dependency may resolve a CUDA build
    pip_install "$TORCH_PIN" -c "$PINS" -e "${SETDIFF_ROOT}[test]"
    check="import torch, deepspeed, megatron.core, setdiff_dist"
    "$VENV/bin/python" -c "$check" >/dev/null 2>&1 || {
        "$VENV/bin/python" -c "$check" || true
        echo "[setdiff] installation failed: see the output above" >&2; exit 1; }
    echo "$want" > "$stamp"
    echo "[setdiff] installed in $(( $(date +%s) - start )) s" >&2
fi
export PATH="$VENV/bin:$PATH"
cd "$SETDIFF_ROOT"
