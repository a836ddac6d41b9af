# shellcheck shell=bash disable=SC2034  # (failed and skipped are the caller's)
# Sourced by tests/gpu/run.sh (and tests/test_gpu_script.py): say MESSAGE, and
# stage NAME LIMIT_S COMMAND..., which runs the command with a time limit (none for a function
# of the caller or a limit of 0), logs it to $OUT/NAME.log and ends in one line of
# $OUT/summary.txt: "ok", "skipped (budget: ...)" (past its limit, or exit 3: the command's own
# budget) or "FAILED" (any other exit, a kill before the limit included). It sets failed=1 on a
# failure and adds NAME to $skipped on a skip. Needs OUT, failed and skipped set. budgeted
# (below) is stage within the whole script's time.

say() { echo "[gpu] $*" | tee -a "$OUT/summary.txt"; }

# stage NAME LIMIT_S COMMAND...: run it with a time limit, log to $OUT/NAME.log, print one line
stage() {
    local name=$1 limit=$2 t0 rc dt result
    shift 2
    t0=$(date +%s)
    if declare -F "$1" > /dev/null; then  # a function of this script: no time limit
        ( "$@" ) > "$OUT/$name.log" 2>&1
    else
        timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    fi
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    result=$(grep -E '^RESULT: |^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected)|^no tests ran|^wheelset: ' \
             "$OUT/$name.log" | tail -n 1 | sed 's/^RESULT: //')
    if [ "$rc" -eq 0 ]; then
        say "$name: ok in ${dt} s${result:+: $result}"
    elif [ "$rc" -eq 3 ] || { [ "$limit" -gt 0 ] && [ "$dt" -ge "$limit" ] &&
                              { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; }; then
        # out of time, not broken: what finished is in the log (a kill before the limit, e.g.
        # the kernel's OOM killer, is a failure below)
        skipped="$skipped $name"
        if [ "$rc" -eq 3 ]; then why="its own budget"; else why="past its ${limit} s limit"; fi
        say "$name: skipped (budget: $why) after ${dt} s${result:+: $result}"
    else
        failed=1
        say "$name: FAILED (exit $rc) in ${dt} s${result:+: $result}"
        echo "----- last lines of $OUT/$name.log" >&2
        tail -n 25 "$OUT/$name.log" >&2
        echo "-----" >&2
    fi
    return "$rc"
}

# budgeted NAME LIMIT_S COMMAND...: stage NAME with its limit cut to what is left of the whole
# script's budget ($TOTAL_S from $start, less the 15 s a kill may take), or "skipped (budget:
# ...)" without running when less than $MIN_STAGE_S (default 15) is left. Needs start and
# TOTAL_S too.
budgeted() {
    local name=$1 limit=$2 left
    shift 2
    left=$(( ${TOTAL_S:?} - ($(date +%s) - ${start:?}) - 15 ))
    if [ "$left" -lt "${MIN_STAGE_S:-15}" ]; then
        skipped="$skipped $name"
        say "$name: skipped (budget: $(( left + 15 )) s left of the script's ${TOTAL_S} s)"
        return 3
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    stage "$name" "$limit" "$@"
}
