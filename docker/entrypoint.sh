#!/usr/bin/env bash
# The image's entry: "gpu-tests" runs the GPU test suite and the bf16 throughput benchmark;
# anything else is run as a command (setdiff-train, setdiff-generate, torchrun, bash, ...).
set -euo pipefail
case "${1:---help}" in
  gpu-tests)
    cd "$SETDIFF_HOME"
    python -m pytest -q -m gpu tests/test_gpu.py
    python benchmarks/train_throughput.py --models 110m 1.3b --precision bf16 --steps 20 ;;
  --help|-h)
    echo "usage: docker run --gpus all setdiff-dist [gpu-tests | COMMAND ...]"
    echo "  gpu-tests                 GPU tests and the 110M / 1.3B bf16 throughput benchmark"
    echo "  setdiff-train --nproc-per-node 8 --config configs/lm1b-110m-setdlm.yaml ..."
    echo "  setdiff-generate --checkpoint runs/... --prompt '...'" ;;
  *) exec "$@" ;;
esac
