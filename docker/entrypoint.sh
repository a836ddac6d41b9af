#!/usr/bin/env bash
# The image's entry: "gpu-tests" runs the GPU test suite and the bf16 throughput benchmark;
# anything else is run as a command (setdiff-train, setdiff-generate, torchrun, bash, ...).
set -euo pipefail
case "${1:---help}" in
  gpu-tests)  # the staged GPU script, on the image's own packages (results in $OUT)
    OUT=${OUT:-$PWD/gpu-results} exec bash "$SETDIFF_HOME/tests/gpu/run.sh" --no-install ;;
  --help|-h)
    echo "usage: docker run --gpus all setdiff-dist [gpu-tests | COMMAND ...]"
    echo "  gpu-tests                 smoke, GPU tests, 110M / 1.3B bf16 throughput (tests/gpu/run.sh)"
    echo "  setdiff-train --nproc-per-node 8 --config configs/lm1b-110m-setdlm.yaml ..."
    echo "  setdiff-generate --checkpoint runs/... --prompt '...'" ;;
  *) exec "$@" ;;
esac
