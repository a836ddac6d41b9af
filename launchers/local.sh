#!/usr/bin/env bash
# Training on one machine (a workstation, or one node without Slurm): one rank per GPU, or
# NPROC_PER_NODE ranks (CPU: gloo). After a crash torchrun restarts the ranks up to MAX_RESTARTS
# times (default 0) and resume=auto continues from the last checkpoint.
#
#   bash launchers/local.sh --config configs/lm1b-110m-setdlm.yaml [key=value ...]
#   NPROC_PER_NODE=2 bash launchers/local.sh --config configs/tiny-cpu.yaml
#
# Ctrl-C or SIGTERM stops it; SIGTERM checkpoints first (exit code 75, see setdiff-train --help).
# The outcome is also in run_dir/exit_status.json.
set -euo pipefail
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [ "$NPROC_PER_NODE" -ge 1 ] || NPROC_PER_NODE=1
fi
command -v torchrun >/dev/null || { echo "torchrun is not on PATH: activate the environment \
that has setdiff-dist (source .venv/bin/activate)" >&2; exit 2; }
exec torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="${MAX_RESTARTS:-0}" -m setdiff_dist.cli.train "$@"
