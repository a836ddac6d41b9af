"""A job that heals or ends on its own: a hung rank ends the job within train.hang_timeout_s,
named, with every rank's stacks in the run directory and the last checkpoint intact."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import run_train, train_command

from setdiff_dist.train.watchdog import EXIT_HUNG, culprit


def test_the_culprit_is_the_silent_rank_else_the_first_to_stop_progressing():
    now = 1000.0
    beat = lambda progress, alive: {"progress_at": progress, "alive_at": alive}  # noqa: E731
    # rank 2 stopped (no heartbeat for 30 s): blamed, though rank 0 stopped progressing first
    assert culprit({0: beat(900, 999), 1: beat(950, 999), 2: beat(960, 970)}, now, 10) == (2, True)
    # every process alive: the one whose progress stopped first (the others then waited on it)
    assert culprit({0: beat(950, 999), 1: beat(900, 999), 2: beat(951, 999)}, now, 10) == (1,
                                                                                          False)


WATCHED = textwrap.dedent("""
    import sys, time
    from setdiff_dist.train.watchdog import Watchdog
    w = Watchdog(sys.argv[1], 1.0, rank=0, world=1, poll_s=0.2)
    for i in range(5):
        w.beat("forward", i)
        time.sleep(0.1)
    def stuck_in_a_collective():
        time.sleep(60)
    stuck_in_a_collective()
""")


def _hung_child(script, tmp_path):
    """``script`` in a child: it ends with the hang code within 20 s; its result."""
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == EXIT_HUNG, res.stderr
    assert time.monotonic() - start < 20
    return res


def test_a_rank_without_progress_dumps_its_stacks_and_exits_with_the_hang_code(tmp_path):
    """The watch alone, in a child without torch: one second without progress ends it."""
    res = _hung_child(WATCHED, tmp_path)
    assert "hang: rank 0 on" in res.stderr and "at step 4 in forward" in res.stderr
    stacks = (tmp_path / "watchdog" / "stacks-rank0.txt").read_text()
    assert "stuck_in_a_collective" in stacks and "Thread" in stacks
    report = json.loads((tmp_path / "watchdog" / "hang.json").read_text())
    assert report["rank"] == 0 and report["step"] == 4 and not report["heartbeat_stopped"]


SECTIONED = textwrap.dedent("""
    import sys, time
    from setdiff_dist.train.watchdog import Watchdog
    w = Watchdog(sys.argv[1], 60.0, rank=0, world=1, poll_s=0.2,
                 limits={"checkpoint": (1.0, "train.save_timeout_s"), "eval": (0.0, "off")})
    w.beat("eval", 3)
    time.sleep(2.0)  # (a phase whose limit is 0 is not watched)
    w.beat("checkpoint", 4)
    def stuck_writing_a_checkpoint():
        time.sleep(60)
    stuck_writing_a_checkpoint()
""")


def test_a_section_ends_after_its_own_timeout_naming_its_key(tmp_path):
    """The watch alone: a phase with a limit of its own (a save's) ends the rank after that
    limit, not the default one, and the line and report name the section's config key."""
    res = _hung_child(SECTIONED, tmp_path)
    assert "at step 4 in checkpoint" in res.stderr and "train.save_timeout_s=1" in res.stderr
    report = json.loads((tmp_path / "watchdog" / "hang.json").read_text())
    assert report["timeout_key"] == "train.save_timeout_s" and report["phase"] == "checkpoint"
    assert "stuck_writing_a_checkpoint" in (tmp_path / "watchdog" / "stacks-rank0.txt").read_text()


@pytest.mark.parametrize("fault,overrides,phase,key", [
    ("hang_startup:engine build:1", ["train.startup_timeout_s=15"], "engine build",
     "train.startup_timeout_s=15"),
    ("hang_save:4:1", ["train.save_timeout_s=15", "checkpoint.interval=2"], "checkpoint",
     "train.save_timeout_s=15")], ids=["start-up", "save"])
def test_a_hang_in_start_up_or_a_save_ends_within_its_section_timeout_naming_the_rank(
        sonnets, tmp_path, fault, overrides, phase, key):
    """Rank 1 of 2 stops without progress as its engine is built, or at the start of its
    write of checkpoint 4 (SETDIFF_FAULT): the job ends with the hang code within the
    section's timeout (15 s, the default watch's 600 s untouched) + 40 s, naming rank 1, the
    section and its key; a save's hang leaves checkpoint 2 ``latest``."""
    from setdiff_dist.checkpoint.files import resolve_latest
    from setdiff_dist.checkpoint.manifest import read_manifest

    run = str(tmp_path / "run")
    start = time.monotonic()
    res = run_train(run, sonnets, *overrides, steps=6, env={"SETDIFF_FAULT": fault})
    took = time.monotonic() - start
    assert res.returncode == EXIT_HUNG, res.stderr[-3000:]
    assert "hang: rank 1 on" in res.stderr and f"in {phase}" in res.stderr, res.stderr[-3000:]
    assert key in res.stderr
    report = json.loads(open(os.path.join(run, "watchdog", "hang.json")).read())
    assert report["rank"] == 1 and report["phase"] == phase
    stacks = open(os.path.join(run, "watchdog", "stacks-rank1.txt")).read()
    assert "hang_here" in stacks, stacks[:2000]
    if phase == "checkpoint":
        assert read_manifest(resolve_latest(run))["step"] == 2
    else:
        assert took < 15 + 90, took  # (the start of two ranks included)


def test_at_a_hang_only_the_first_rank_reads_every_heartbeat(tmp_path, monkeypatch):
    """Pure logic: the rank that claims the hang reads the N heartbeats and writes the report;
    one that finds the claim reads none and takes that report; a claim whose report never
    comes (its rank died) is reported by the next rank itself."""
    from setdiff_dist.train import watchdog as wd

    reads = []
    real = wd.read_heartbeats
    monkeypatch.setattr(wd, "read_heartbeats", lambda d: reads.append(d) or real(d))
    first = wd.Watchdog(str(tmp_path), 60.0, rank=0, world=2, poll_s=0.1)
    second = wd.Watchdog(str(tmp_path), 60.0, rank=1, world=2, poll_s=0.1)
    for w in (first, second):  # (their threads would end this process on the report)
        w._stop.set()
        w._thread.join()
    try:
        assert first._report(61.0)["reported_by"] == 0 and len(reads) == 1
        assert second._report(61.0) is None and len(reads) == 1  # (the claim and its report)
        (tmp_path / wd.DIRECTORY / wd.REPORT).unlink()  # a claim without a report
        start = time.monotonic()
        assert second._report(61.0)["reported_by"] == 1 and len(reads) == 2
        assert time.monotonic() - start >= second.stale_after * 0.9
    finally:
        for w in (second, first):
            w.close()


def test_nccl_records_its_collectives_into_the_run_directory(tmp_path):
    """Pure logic: an NCCL group is made with torch's flight recorder on, dumped per rank into
    run_dir/nccl_trace/ on a collective's timeout (the GPU path: torch's NCCL reads these);
    a hang watch where that directory exists but no NCCL runs still ends the rank."""
    from setdiff_dist.parallel.state import NCCL_TRACE, flight_recorder_env

    env = flight_recorder_env(str(tmp_path))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) >= 1000
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / NCCL_TRACE / "rank")
    (tmp_path / NCCL_TRACE).mkdir()
    _hung_child(WATCHED, tmp_path)


def _wait_for(predicate, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the run ended before it could be stopped"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_named_with_every_ranks_stacks(sonnets, tmp_path):
    """SIGSTOP one of 2 gloo ranks mid-run: the job exits with code 76 within hang_timeout_s
    + 30 s, names that rank and its host, leaves both ranks' stacks (the stopped one's too) in
    run_dir/watchdog/, and the last checkpoint is intact and resumes."""
    from setdiff_dist.checkpoint.files import resolve_latest
    from setdiff_dist.checkpoint.manifest import read_manifest

    run = str(tmp_path / "run")
    # (a save every 2 steps: the stop often lands while rank 0 saves, which the hang watch
    # gives train.save_timeout_s)
    proc = subprocess.Popen(train_command(run, sonnets, "train.eval_batches=1",
                                          "train.hang_timeout_s=20", "train.save_timeout_s=20",
                                          "checkpoint.interval=2",
                                          "optimizer.schedule=constant", steps=100000),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        beat = os.path.join(run, "watchdog", "rank1.json")
        _wait_for(lambda: os.path.exists(os.path.join(run, "checkpoints", "latest"))
                  and os.path.exists(beat), proc)
        with open(beat) as fh:
            victim = json.load(fh)["pid"]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_HUNG, err[-3000:]
    assert took < 20 + 30, took
    assert "hang: rank 1 on" in err and "stopped responding" in err
    report = json.loads(open(os.path.join(run, "watchdog", "hang.json")).read())
    assert report["rank"] == 1 and report["pid"] == victim and report["heartbeat_stopped"]
    for rank in (0, 1):
        stacks = open(os.path.join(run, "watchdog", f"stacks-rank{rank}.txt")).read()
        assert 'File "' in stacks and "setdiff_dist" in stacks, (rank, stacks[:2000])
    with open(os.path.join(run, "exit_status.json")) as fh:
        status = json.load(fh)
    assert status["outcome"] == "hung" and status["exit_code"] == EXIT_HUNG
    # the last checkpoint: complete, its checksums right, and training goes on from it
    path = resolve_latest(run)
    step = read_manifest(path)["step"]
    assert status["checkpoint"] == path
    res = run_train(run, sonnets, "train.eval_batches=1", "optimizer.schedule=constant",
                    "checkpoint.checksums=true", steps=step + 1)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {path} at step {step}" in res.stdout
    assert os.path.isdir(os.path.join(run, "watchdog.previous"))


def test_a_rank_over_the_margin_for_the_set_intervals_is_named_and_cleared():
    from setdiff_dist.train.timers import Stragglers

    s = Stragglers(margin=0.3, intervals=3, floor_s=0.005)
    stages = [0, 0, 0, 0]
    seen = [s.update([0.10, 0.10, 0.15, 0.10], stages) for _ in range(3)]
    assert [x["stragglers"] for x in seen] == [[], [], [2]] and seen[2]["new"] == [2]
    assert seen[2]["forward_slowest_rank"] == 2
    assert seen[2]["forward_ratio_max"] == pytest.approx(1.5)
    # one interval back under the margin clears it, and the count starts over
    back = s.update([0.10, 0.10, 0.11, 0.10], stages)
    assert back["stragglers"] == [] and back["cleared"] == [2]
    # noise: 1.25x is under the margin; 2x of 2 ms is under the floor
    quiet = Stragglers(margin=0.3, intervals=1, floor_s=0.005)
    assert quiet.update([0.100, 0.125, 0.1], [0, 0, 0])["stragglers"] == []
    assert quiet.update([0.002, 0.004, 0.002], [0, 0, 0])["stragglers"] == []
    # pipeline stages are compared within themselves: the last stage's larger forward is no
    # straggler; a slow rank of the first stage is
    staged = Stragglers(margin=0.3, intervals=1)
    assert staged.update([0.1, 0.1, 0.3, 0.3], [0, 0, 1, 1])["stragglers"] == []
    assert staged.update([0.1, 0.2, 0.1, 0.3, 0.3, 0.3], [0, 0, 0, 1, 1, 1])["stragglers"] == [1]


def test_an_injected_slow_rank_is_named_within_three_intervals_and_no_rank_without_it(
        trained, sonnets, tmp_path):
    """A 0.2 s sleep in each of rank 1's forwards (the test-only SETDIFF_TEST_SLOW_RANK) names
    rank 1 by the third log interval, in metrics.jsonl and in a line of its own; the session's
    reference run, on the same 2 gloo ranks without it, names a rank only on the evidence: the
    slowest by more than the margin in each of the three intervals before (on two cores that
    CI shares between two test sessions, a rank can be that slow for a while; the noise the
    margin and floor ignore is the test above's)."""
    env = dict(os.environ, SETDIFF_TEST_SLOW_RANK="1:0.2")
    res = run_train(tmp_path / "run", sonnets, "train.eval_batches=1",
                    "checkpoint.save_at_end=false", steps=4, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _train_rows(tmp_path / "run")
    assert [r["stragglers"] for r in rows][:3] == [[], [], [1]], rows
    assert rows[2]["forward_slowest_rank"] == 1 and rows[2]["forward_ratio_max"] > 1.3
    assert "straggler: rank 1 on" in res.stdout
    reference = _train_rows(trained())
    assert reference, reference
    for i, row in enumerate(reference):
        for rank in row["stragglers"]:
            before = reference[max(0, i - 2):i + 1]
            assert len(before) == 3 and all(r["forward_slowest_rank"] == rank
                                            and r["forward_ratio_max"] > 1.3
                                            for r in before), reference


def _train_rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "stragglers" in r]


def _pid_of(run, rank, other_than=None, proc=None):
    """The pid in ``rank``'s heartbeat file, once it is not ``other_than``."""
    path = os.path.join(run, "watchdog", f"rank{rank}.json")

    def found():
        try:
            with open(path) as fh:
                return json.load(fh)["pid"] != other_than
        except (OSError, ValueError, KeyError):
            return False

    _wait_for(found, proc)
    with open(path) as fh:
        return json.load(fh)["pid"]


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_which_ends_with_the_uninterrupted_losses(
        trained, sonnets, tmp_path):
    """SIGKILL rank 1 once its run has a checkpoint (step 3 of 6), with train.max_restarts=1:
    every rank starts again from that checkpoint and the job ends with exit code 0 and the
    session's uninterrupted reference run's losses, bit for bit (fp32)."""
    from helpers import REFERENCE, REFERENCE_STEPS, child_env, losses

    run = str(tmp_path / "run")
    # (rank 0's forwards slowed, so that the kill lands before the last step)
    env = child_env(dict(os.environ, SETDIFF_TEST_SLOW_RANK="0:0.3"))
    proc = subprocess.Popen(train_command(run, sonnets, *REFERENCE, "train.max_restarts=1",
                                          steps=REFERENCE_STEPS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run, "checkpoints", "latest")), proc)
        os.kill(_pid_of(run, 1, proc=proc), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "rank 1 died (signal 9)" in err and "restart 1 of 1 (rank 1: signal 9)" in err
    assert "resumed from" in out and "at step 3" in out
    want = losses(trained())
    assert len(want) == REFERENCE_STEPS and losses(run) == want


@pytest.mark.slow
def test_with_the_restarts_spent_the_job_ends_naming_the_failing_rank(sonnets, tmp_path):
    """max_restarts=1 and rank 1 killed in both attempts: the job ends (exit 1) saying that
    rank failed again and no restart is left; the last checkpoint stays intact."""
    from helpers import child_env

    from setdiff_dist.checkpoint.files import resolve_latest

    run = str(tmp_path / "run")
    env = child_env(dict(os.environ, SETDIFF_TEST_SLOW_RANK="0:0.3"))
    proc = subprocess.Popen(train_command(run, sonnets, "train.max_restarts=1",
                                          "checkpoint.interval=2", steps=100),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run, "checkpoints", "latest")), proc)
        first = _pid_of(run, 1, proc=proc)
        os.kill(first, signal.SIGKILL)
        os.kill(_pid_of(run, 1, other_than=first, proc=proc), signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "restart 1 of 1 (rank 1: signal 9)" in err
    assert "rank 1 failed again (signal 9) and no restart is left (train.max_restarts=1" in err
    assert resolve_latest(run) is not None


def test_a_diverged_run_is_not_restarted(sonnets, tmp_path):
    """A loss that stays non-finite (an absurd learning rate) is deterministic: with
    train.max_restarts=2 the run still ends at once, exit code 3 (outcome "diverged", not
    restartable), no restart."""
    from setdiff_dist.errors import EXIT_DIVERGED

    res = run_train(tmp_path, sonnets, "optimizer.lr=1e30", "optimizer.grad_clip=0",
                    "train.max_nonfinite_steps=2", "optimizer.warmup_steps=0",
                    "optimizer.schedule=constant", "optimizer.min_lr=0", "train.max_restarts=2",
                    nproc=1, steps=6)
    assert res.returncode == EXIT_DIVERGED, res.stderr[-3000:]
    assert "2 consecutive steps with a non-finite loss or gradient norm" in res.stderr
    assert "restart" not in res.stderr and "died" not in res.stderr, res.stderr[-3000:]
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert status["outcome"] == "diverged" and status["exit_code"] == EXIT_DIVERGED
    assert status["restartable"] is False


STUBS = {  # Slurm's commands for train.sbatch, as a failed job on node n1 sees them
    "scontrol": """#!/bin/bash
echo "$*" >> "$STUB_LOG"
case "$1 $2" in
    "show hostnames") echo n1 ;;
    "show job") echo "JobId=$SLURM_JOB_ID ExcNodeList=(null)" ;;
esac
""",
    "srun": """#!/bin/bash
echo "srun: error: n1: task 0: Exited with exit code 1" >&2
exit 1
""",
    "torchrun": "#!/bin/bash\nexit 0\n",
}


@pytest.mark.parametrize("outcome,code,hangs_on_n1,requeued", [
    ("diverged", 3, 0, False), ("invalid", 2, 0, False), ("failed", 1, 0, False),
    ("hung", 76, 1, False), ("hung", 76, 2, True)])
def test_train_sbatch_excludes_a_node_only_when_it_hung_twice(tmp_path, outcome, code,
                                                              hangs_on_n1, requeued):
    """train.sbatch after its job step ended with the in-job restarts spent, Slurm's commands
    stubbed: the job is requeued without n1 only when the hang reports of this job
    (faults.jsonl) name n1 twice; a crash, a single hang, a divergence or a refusal ends the
    job and excludes no node."""
    from setdiff_dist.train.run_dir import write_exit_status

    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    run, log = tmp_path / "run", tmp_path / "scontrol.log"
    write_exit_status(str(run), outcome, code, 4, None)
    with open(run / "faults.jsonl", "w") as fh:
        hangs = [{"job": "123", "kind": "hang", "node": "n1"}] * hangs_on_n1
        for fault in hangs + [{"job": "99", "kind": "hang", "node": "n2"}] * 2:
            fh.write(json.dumps(fault) + "\n")
    env = dict(os.environ, STUB_LOG=str(log), SLURM_JOB_ID="123", SLURM_JOB_NODELIST="n1",
               SLURM_NNODES="1", SETDIFF_HOME=os.getcwd(),
               PATH=os.pathsep.join([str(stubs), os.path.dirname(sys.executable),
                                     os.environ["PATH"]]))
    res = subprocess.run(["bash", os.path.join("launchers", "slurm", "train.sbatch"),
                          "--config", "configs/tiny-cpu.yaml", f"run_dir={run}",
                          "train.max_restarts=2"], capture_output=True, text=True, env=env,
                         timeout=120)
    calls = log.read_text().splitlines()
    if requeued:
        assert res.returncode == 0, res.stderr
        assert "requeuehold 123" in calls and "release 123" in calls, calls
        assert "update JobId=123 ExcNodeList=n1" in calls, calls
        assert json.loads((run / "faults.jsonl").read_text().splitlines()[-1])["kind"] == \
            "exclude-node"
    else:
        assert res.returncode != 0, res.stderr
        assert calls == ["show hostnames n1"], calls
        said = (f"not requeueing: the run ended {outcome}" if outcome in ("diverged", "invalid")
                else "in-job restart(s) of train.max_restarts are spent and no node is to blame")
        assert said in res.stderr, res.stderr


def test_a_restarted_run_logs_each_step_once(tmp_path):
    """metrics.jsonl after a restart from the step-3 checkpoint of a run that had logged steps
    1-5 (and a line cut short by the crash): the lines past step 3 go, so that the restart's
    steps 4.. appear once."""
    from setdiff_dist.train.metrics import MetricsLogger

    lines = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    lines.insert(3, {"step": 3, "valid_loss": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines)
                                            + '{"step": 6, "lo')
    logger = MetricsLogger(str(tmp_path), True, 6, 1e6, 1, tensorboard=False, start_step=3)
    for step in (4, 5):
        logger.log({"step": step, "loss": 0.1, "lr": 1e-3, "grad_norm": 1.0}, 100, 1.0)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "valid_loss" in r] == [3]


def test_the_exit_status_of_a_hang_has_the_trainers_step(tmp_path):
    """The hang's record in exit_status.json gives the trainer's step when the hang ends the
    process (as every outcome does), not the hang report's step, which is the culprit's last
    heartbeat (another rank's, seconds old)."""
    from types import SimpleNamespace

    from setdiff_dist.train.run_dir import record_hang

    trainer = SimpleNamespace(step=5, last_step_at=None)
    on_hang = record_hang(str(tmp_path), trainer)
    trainer.step, trainer.last_step_at = 9, 1234.5
    on_hang({"rank": 1, "step": 6, "phase": "forward"})
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert {k: status[k] for k in ("outcome", "exit_code", "step", "checkpoint", "restartable",
                                   "last_step_at")} == \
        {"outcome": "hung", "exit_code": EXIT_HUNG, "step": 9, "checkpoint": None,
         "restartable": True, "last_step_at": 1234.5}


def _as_start(monkeypatch, job="7", allocation=0, restart=0):
    """This process as a start of a job: Slurm's job id and requeue count, torch elastic's
    restart count (none of them set where a value is None)."""
    for key, value in (("SLURM_JOB_ID", job), ("SLURM_RESTART_COUNT", allocation),
                       ("TORCHELASTIC_RESTART_COUNT", restart)):
        monkeypatch.delenv(key, raising=False)
        if value is not None:
            monkeypatch.setenv(key, str(value))
    for key in ("TORCHELASTIC_RUN_ID", "SETDIFF_LAUNCH_ID", "SETDIFF_RESTART"):
        monkeypatch.delenv(key, raising=False)


def test_a_restart_after_a_failure_no_restart_gets_past_ends_at_once(tmp_path, monkeypatch):
    """torch elastic restarts the ranks after any non-zero exit: a restart that finds the
    previous start of the same allocation ended diverged (or refused, or stopped on a signal)
    ends at once with its code; after a crash, or a record of another job or allocation, or in
    the first start, it goes on."""
    from setdiff_dist.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_PREEMPTED
    from setdiff_dist.train.run_dir import refuse_pointless_restart, write_exit_status

    run = str(tmp_path)
    _as_start(monkeypatch, restart=0)
    write_exit_status(run, "diverged", EXIT_DIVERGED, 4, None)
    assert refuse_pointless_restart(run) is None  # (the first start: nothing to go by)
    _as_start(monkeypatch, restart=1)
    assert refuse_pointless_restart(run) == EXIT_DIVERGED
    _as_start(monkeypatch, allocation=0)
    write_exit_status(run, "preempted", EXIT_PREEMPTED, 4, None)
    _as_start(monkeypatch, restart=2)
    assert refuse_pointless_restart(run) == EXIT_PREEMPTED
    for job, allocation in (("8", 0), ("7", 1)):  # another job; the next allocation
        _as_start(monkeypatch, job=job, allocation=allocation, restart=1)
        assert refuse_pointless_restart(run) is None
    _as_start(monkeypatch)
    write_exit_status(run, "failed", EXIT_FAILED, 4, None)
    _as_start(monkeypatch, restart=1)
    assert refuse_pointless_restart(run) is None
    _as_start(monkeypatch, job=None, restart=1)  # (no launcher's job: never refused)
    write_exit_status(run, "diverged", EXIT_DIVERGED, 4, None)
    assert refuse_pointless_restart(run) is None


def test_a_start_after_a_fault_knows_the_last_step_before_it(tmp_path, monkeypatch):
    """What the first step of a restart or a requeue reports its lost time from: the previous
    start's exit status when its rank 0 wrote one, else the later of rank 0's last heartbeat
    (its step in progress) and metrics.jsonl's last line; nothing in a first start, nor from
    another job's records."""
    from setdiff_dist.train.run_dir import fault_before_this_start, write_exit_status
    from setdiff_dist.train.watchdog import DIRECTORY, attempt_id, heartbeat_path

    run = str(tmp_path)
    _as_start(monkeypatch)
    write_exit_status(run, "hung", EXIT_HUNG, 12, None, last_step_at=1000.0)
    assert fault_before_this_start(run, 0) is None
    _as_start(monkeypatch, restart=1)
    assert fault_before_this_start(run, 1) == ("restart 1", 1000.0, 12)
    # rank 0 was killed: no exit status; its heartbeat and the metrics say how far it got
    os.remove(os.path.join(run, "exit_status.json"))
    os.makedirs(os.path.join(run, DIRECTORY))
    with open(heartbeat_path(run, 0), "w") as fh:
        json.dump({"pid": -1, "attempt": attempt_id(), "step": 15, "progress_at": 1100.0}, fh)
    with open(os.path.join(run, "metrics.jsonl"), "w") as fh:
        fh.write(json.dumps({"step": 13, "loss": 1.0}) + "\n")
    os.utime(os.path.join(run, "metrics.jsonl"), (1050.0, 1050.0))
    assert fault_before_this_start(run, 1) == ("restart 1", 1100.0, 14)
    os.utime(os.path.join(run, "metrics.jsonl"), (1200.0, 1200.0))
    assert fault_before_this_start(run, 1) == ("restart 1", 1200.0, 13)
    _as_start(monkeypatch, allocation=1)  # Slurm requeued the job after its node was lost
    assert fault_before_this_start(run, 0) == ("requeue 1", 1200.0, 13)
    _as_start(monkeypatch, job="8", allocation=1)  # another job's records: nothing
    assert fault_before_this_start(run, 0) is None


def test_torchrun_restarts_on_the_agents_shared_store_are_refused(monkeypatch):
    """The agents' shared rendezvous store keeps the last start's keys (pytorch#135712): a
    launch that would restart on it is refused before it joins, saying what to export."""
    from setdiff_dist.parallel.state import LaunchError, init_distributed

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    with pytest.raises(LaunchError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        init_distributed("gloo")


def test_the_phase_timers_wait_for_the_device_only_when_they_report():
    """On a device the phase boundaries are events, read when the timers report: no wait for
    the device inside a step (one there would serialize the overlapped parameter gather), the
    phases still exclusive and adding up to the step."""
    import torch
    from comm_record import RecordingDevice

    from setdiff_dist.train.timers import PhaseTimers

    timers = PhaseTimers()
    device = RecordingDevice(lambda: timers._step_start is not None)
    timers.clock = device.clock()
    for _ in range(3):
        timers.start_step()
        with timers.phase("data_wait"):
            time.sleep(0.01)
        with timers.phase("backward"):
            time.sleep(0.01)
            with timers.phase("grad_reduce"):
                time.sleep(0.02)
        with timers.phase("optimizer"):
            with timers.phase("param_gather"):
                time.sleep(0.01)
        timers.end_step()
    assert device.waits == []
    out = timers.report(torch.device("cpu"))
    assert device.waits and not any(device.waits)  # (only now, between steps)
    phases = sum(out[f"time_{k}"] for k in ("data_wait", "forward", "backward", "grad_reduce",
                                           "optimizer", "param_gather"))
    assert phases == pytest.approx(out["step_time"], rel=0.05)
    assert out["time_grad_reduce"] >= 0.02 and 0.01 <= out["time_backward"] < 0.02
    assert out["time_optimizer"] < 0.005 <= out["time_param_gather"]
    with timers.phase("checkpoint"):  # (a report inside a phase keeps it open)
        out = timers.report(torch.device("cpu"))
        time.sleep(0.01)
    assert out["time_checkpoint"] == 0 and timers.totals["checkpoint"] >= 0.01
