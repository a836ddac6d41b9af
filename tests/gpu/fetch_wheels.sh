#!/usr/bin/env bash
# Fill wheels/ (git-ignored) with exactly what tests/gpu/run.sh carries to the lent GPU machine:
# the pins of tests/gpu/carry.txt (what the machine's image lacks), for CPython 3.12 on manylinux
# x86_64, and nothing else. Run it here, where the package index is reachable; then carry wheels/.
#
#   bash tests/gpu/fetch_wheels.sh                      # wheels/ for the GPU machine (3.12)
#   PYTHON_VERSION=3.11 WHEELS=DIR bash tests/gpu/fetch_wheels.sh   # e.g. for the CPU rehearsal
#
# The folder is emptied first (two versions of one package break the install), every download
# must succeed, and the result is checked by tests/gpu/wheelset.py (exit 2 with the reason).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON_VERSION:-3.12}
DEST=${WHEELS:-wheels}
PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
rm -rf "$DEST"
mkdir -p "$DEST"
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' tests/gpu/carry.txt | grep -v '^$')
target=(--python-version "$PY" --implementation cp --only-binary=:all: --no-deps
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform any -d "$DEST" --quiet
        --disable-pip-version-check)
sdist_only=()
for pin in "${pins[@]}"; do
    case "$pin" in deepspeed==*) sdist_only+=("$pin"); continue ;; esac
    "$PYTHON" -m pip download "${target[@]}" "$pin" 2> >(grep -v "^WARNING: Location" >&2)
done
# DeepSpeed publishes only an sdist: build its pure-Python wheel (its ops are JIT-built on use)
for pin in "${sdist_only[@]}"; do
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps \
        --disable-pip-version-check "$pin" -w "$DEST" 2> >(grep -v "^WARNING: Location" >&2)
done
"$PYTHON" tests/gpu/wheelset.py check --wheels "$DEST" --python "$PY"
du -sh "$DEST"
