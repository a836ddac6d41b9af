# shellcheck shell=bash
# Sourced by the sbatch scripts of this directory (not run by itself).
#
# Sets MASTER_ADDR / MASTER_PORT / NPROC_PER_NODE for the allocation and defines
# `setdiff_torchrun ARGS...`, which starts one torchrun agent per node through srun with a c10d
# rendezvous on the allocation's first node.
#
# Environment knobs (all optional):
#   SETDIFF_ENV       a file to source first on every node (module loads, a virtualenv's
#                     bin/activate, ...); by default the submitting shell's environment is used
#                     (sbatch --export=ALL), so activate the environment before sbatch
#   NPROC_PER_NODE    ranks per node; default: the GPUs Slurm gave the node, else 1
#   MASTER_PORT       rendezvous port; default 20000 + job id mod 9400, so that concurrent jobs
#                     on shared nodes do not collide and a requeued job gets the same one; below
#                     torch's defaults (29400, 29500) and the kernel's ephemeral ports (32768 and
#                     up), which any outgoing connection of the node may hold
#   RDZV_TIMEOUT      seconds the agents wait for each other (default 900)
#   MAX_RESTARTS      in-job restarts (torchrun --max-restarts; train.sbatch sets it from
#                     train.max_restarts): after a rank dies, every node's agent stops its
#                     ranks and starts them again in the same allocation, and they resume from
#                     the last checkpoint (default 0: the first failure ends the step). Each
#                     start gets a new rendezvous store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1):
#                     the agents' shared one keeps the last start's keys (pytorch#135712)
# NCCL / gloo (exported by you, passed through to every rank):
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME   the interface to use (e.g. ib0, eth0, ^lo,docker)
#   NCCL_IB_HCA, NCCL_IB_DISABLE=1            InfiniBand adapters, or plain TCP
#   NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET) when a job hangs at start-up
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1         (torch's default) turns a hung collective into an
#                                             error after the process-group timeout
#   TORCH_DISTRIBUTED_DEBUG=DETAIL            reports mismatched collectives
#   OMP_NUM_THREADS                           CPU threads per rank (torchrun sets 1 by default)
# CPUs: each node's one task (the torchrun agent and all its ranks and loader workers) gets every
# CPU the job holds there (CPUS_PER_TASK overrides); train.sbatch asks for whole nodes.
# SIGTERM (Slurm's own preemption, scancel): the agents ignore it (torchrun's
# --signals-to-handle without SIGTERM) and the ranks, which get it too, checkpoint at the next
# step and exit 75. A large checkpoint must be written before Slurm's SIGKILL: give the
# partition a PreemptMode=REQUEUE GraceTime (and KillWait) longer than one step plus one save,
# or rely on train.sbatch's --signal=B:USR1@300 warning, which comes 300 s before the end.

if [ -n "${SETDIFF_ENV:-}" ]; then
    # shellcheck disable=SC1090
    source "$SETDIFF_ENV"
fi
command -v torchrun >/dev/null || { echo "setdiff: torchrun is not on PATH; activate the \
environment that has setdiff-dist before sbatch, or set SETDIFF_ENV" >&2; exit 2; }

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 9400 ))}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-1}
fi
export MASTER_ADDR MASTER_PORT NPROC_PER_NODE

SETDIFF_LAUNCHERS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

setdiff_torchrun() {
    # agent.sh: the agents ignore SIGUSR1 and SIGTERM, which reach the ranks (a preemption
    # warning, a preemption: they checkpoint); an agent with no ranks running when SIGTERM
    # comes (it waits for a lost node in the rendezvous) is ended at once, not after KillWait
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # (MAX_RESTARTS above)
    srun --kill-on-bad-exit=1 --ntasks-per-node=1 --nodes="$SLURM_NNODES" \
        --cpus-per-task="${CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}" \
        bash "$SETDIFF_LAUNCHERS/agent.sh" \
        torchrun --signals-to-handle=SIGINT,SIGHUP,SIGQUIT \
        --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d \
        --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
        --rdzv-conf="join_timeout=${RDZV_TIMEOUT:-900}" --max-restarts="${MAX_RESTARTS:-0}" \
        "$@"
}

echo "[setdiff] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST:" \
     "$SLURM_NNODES node(s) x $NPROC_PER_NODE rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
