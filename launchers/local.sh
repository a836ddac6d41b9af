#!/usr/bin/env bash
# Training on one machine (a workstation, or one node without Slurm): one rank per GPU, or
# NPROC_PER_NODE ranks (CPU: gloo). With MAX_RESTARTS=N torchrun restarts the ranks after a crash
# up to N times (default 0) and resume=auto continues from the last checkpoint.
#
#   bash launchers/local.sh --config configs/lm1b-110m-setdlm.yaml [key=value ...]
#   NPROC_PER_NODE=2 bash launchers/local.sh --config configs/tiny-cpu.yaml
#
# Ctrl-C stops it with a checkpoint (exit code 130, outcome "paused"); SIGTERM too (exit code
# 75, "preempted"): see setdiff-train --help. The outcome is also in run_dir/exit_status.json.
# Without restarts the ranks are started by setdiff-train itself, which forwards the signals and
# exits with the trainer's code; with MAX_RESTARTS > 0 torchrun starts them, and a stopped job
# exits with torchrun's code (run_dir/exit_status.json still says how it ended).
set -euo pipefail
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [ "$NPROC_PER_NODE" -ge 1 ] || NPROC_PER_NODE=1
fi
python -c 'import setdiff_dist' 2>/dev/null || { echo "setdiff-dist is not importable by \
$(command -v python || echo python): activate its environment (source .venv/bin/activate)" >&2
    exit 2; }
if [ "${MAX_RESTARTS:-0}" -gt 0 ]; then
    # a new rendezvous store for each start: the agent's shared one keeps the last start's
    # keys, and the restarted ranks would fail to connect (pytorch/pytorch#135712)
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    exec torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" \
        --max-restarts="$MAX_RESTARTS" -m setdiff_dist.cli.train "$@"
fi
exec python -m setdiff_dist.cli.train --nproc-per-node "$NPROC_PER_NODE" "$@"
