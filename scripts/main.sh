#!/usr/bin/env bash
# The main job on a CPU: set up on first use, then run the end-to-end pipeline.
# Extra arguments are config overrides, e.g.  bash scripts/main.sh train.steps=50
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec setdiff-demo --config configs/tiny-cpu.yaml "$@"
