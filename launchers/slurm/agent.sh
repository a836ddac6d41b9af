#!/usr/bin/env bash
# One node's torch elastic agent under srun (common.sh: setdiff_torchrun): `agent.sh torchrun
# ARGS...` runs the agent with SIGUSR1 and SIGTERM ignored (a signal ignored before exec stays
# ignored) and stands by it for SIGTERM:
# - SIGUSR1 (train.sbatch's preemption warning) reaches the ranks, which install their own
#   handler, without killing torchrun, whose default action on it is to die.
# - SIGTERM (Slurm ending the step: a preemption, scancel, the requeue after a lost node) also
#   reaches the ranks, which checkpoint at the next step and exit; torchrun would otherwise kill
#   them 30 s after it, mid-checkpoint. But an agent with no ranks running is between two
#   starts of them, waiting in the rendezvous for peers (a node is gone): it has nothing to
#   save and would only sit out Slurm's KillWait before its SIGKILL, so it is ended at once;
#   one whose ranks still run (they may be saving, or still failing on the lost peer) is
#   ended as soon as they have exited: after SIGTERM it must not start them again, and
#   waiting in a rendezvous for a peer that is gone only holds the node. Either end is a line
#   of the log and, where train.sbatch names it (SETDIFF_FAULTS_FILE), of the run's
#   faults.jsonl (kind "agent-ended"): the log line goes through srun, which the ending step
#   can take down before it arrives.
#
# It also names the rendezvous store's host: the allocation's first node (SLURM_NODEID 0, the
# rendezvous endpoint's). torch elastic would otherwise let every agent whose address matches
# the endpoint's host it, first come: on nodes that share an address (emulated nodes, some
# multi-homed hosts) the store could live on any node and die with it.
set -u
args=()
for a in "$@"; do
    case "$a" in
        --rdzv-conf=*) a="$a,is_host=$([ "${SLURM_NODEID:-0}" = 0 ] && echo 1 || echo 0)" ;;
    esac
    args+=("$a")
done
(trap '' USR1 TERM; exec "${args[@]}") &
agent=$!
trap '' USR1

ranks_running() { pgrep -P "$agent" >/dev/null; }
end_agent() {  # end_agent WHY: the agent is ended at Slurm's SIGTERM, and why
    local node=${SLURMD_NODENAME:-$(hostname)}
    echo "[setdiff] $(date -Is) $node: $1 (the step is ending; the agent would wait for a" \
         "peer that is gone or start the ranks again): ending the agent now" >&2
    # the log line travels through srun, which the ending step may take down before it arrives;
    # the run's fault history (train.sbatch exports its path) keeps it whatever srun does
    [ -n "${SETDIFF_FAULTS_FILE:-}" ] && printf '{"time": %s, "job": "%s", "allocation": %s, %s}\n' \
        "$(date +%s.%N)" "${SLURM_JOB_ID:-}" "${SLURM_RESTART_COUNT:-0}" \
        "\"kind\": \"agent-ended\", \"node\": \"$node\", \"detail\": \"$1\"" \
        >>"$SETDIFF_FAULTS_FILE" 2>/dev/null
    kill -KILL "$agent" 2>/dev/null
}
# shellcheck disable=SC2329  # invoked by the TERM trap below
on_term() {
    command -v pgrep >/dev/null || return 0  # (cannot tell: the ranks may be saving)
    [ -n "${watcher:-}" ] && return 0
    if ! ranks_running; then
        end_agent "SIGTERM while no rank runs here"
        return 0
    fi
    # the ranks got the SIGTERM too: let them finish (a checkpoint) and end the agent after
    (while kill -0 "$agent" 2>/dev/null; do
         ranks_running || { end_agent "the ranks exited after SIGTERM"; break; }
         sleep 0.5
     done) &
    watcher=$!
}
trap on_term TERM

# `wait` returns early on a trap, so wait until the agent is really gone
rc=0
while :; do
    wait "$agent" && rc=0 || rc=$?
    kill -0 "$agent" 2>/dev/null || break
done
exit "$rc"
