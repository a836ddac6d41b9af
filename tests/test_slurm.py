"""The Slurm launchers on a real Slurm cluster: three emulated nodes on this machine (jobs take
two; the third is where a job goes when a node is lost).

The cluster is the one ``launchers/slurm/cluster.sh`` starts (``.ci/run`` starts it and stops it
on exit); without one, this module starts it itself when it can (root, apt) and stops it after.
Where Slurm cannot be installed the tests are skipped, unless ``SETDIFF_REQUIRE_SLURM=1`` (as in
CI), which turns that into a failure.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import losses, sonnet_shards

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

CLUSTER = os.path.join("launchers", "slurm", "cluster.sh")
TRAIN = os.path.join("launchers", "slurm", "train.sbatch")
INFER = os.path.join("launchers", "slurm", "infer.sbatch")
BASE = os.environ.get("SETDIFF_SLURM_BASE", "/tmp/setdiff-slurm")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _env():
    env = dict(os.environ, SLURM_CONF=os.path.join(BASE, "slurm.conf"))
    # the job's ranks need this environment's torchrun and python (sbatch --export=ALL)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _cluster_up():
    return subprocess.run(["bash", CLUSTER, "status"], capture_output=True,
                          env=_env()).returncode == 0


@pytest.fixture(scope="module")
def cluster():
    """The cluster, this module's alone while it runs: a second test session on this machine
    (CI runs the slow tier beside the default one) waits for it rather than submitting beside
    its jobs or losing a node under them."""
    import fcntl

    os.makedirs(BASE, exist_ok=True)
    with open(os.path.join(BASE, "tests.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _cluster()


def _cluster():
    started = False
    if not _cluster_up():
        res = subprocess.run(["bash", CLUSTER, "start", "3"], capture_output=True, text=True)
        if res.returncode != 0:
            if os.environ.get("SETDIFF_REQUIRE_SLURM") == "1":
                pytest.fail(f"cannot start the Slurm cluster:\n{res.stderr[-2000:]}")
            pytest.skip(f"no Slurm cluster here: {res.stderr.strip().splitlines()[-1:]}")
        started = True
    yield _env()
    if started:
        subprocess.run(["bash", CLUSTER, "stop"], capture_output=True)


def _job(jid, env):
    out = subprocess.run(["scontrol", "show", "job", "-o", str(jid)], capture_output=True,
                         text=True, env=env).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _daemons():
    """{daemon: alive?} from the cluster's pid files (slurmctld, slurmd-n1, ...)."""
    import glob

    out = {}
    for pidfile in sorted(glob.glob(os.path.join(BASE, "run", "*.pid"))):
        name = os.path.basename(pidfile)[:-len(".pid")]
        try:
            with open(pidfile) as fh:
                os.kill(int(fh.read().strip()), 0)
            out[name] = True
        except (OSError, ValueError):
            out[name] = False
    return out


def _cluster_report(why):
    """An AssertionError saying ``why`` with what the daemons say: which died, and the end of
    each one's log (a daemon that dies under load is the cluster's failure, not the job's)."""
    import glob

    lines = [why, f"daemons alive: {_daemons()}"]
    for log in sorted(glob.glob(os.path.join(BASE, "log", "*"))):
        with open(log, errors="replace") as fh:
            tail = fh.read()[-1500:]
        lines.append(f"--- {log} (last lines)\n{tail}")
    cores = glob.glob(os.path.join(BASE, "core*"))
    if cores:
        lines.append(f"core files: {cores}")
    return AssertionError("\n".join(lines))


def _wait(jid, env, timeout=300):
    """The job's final record; fails at once, with the daemons' logs, if a daemon died."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = _job(jid, env)
        if job.get("JobState") in DONE:
            return job
        dead = [d for d, alive in _daemons().items() if not alive]
        if dead:
            subprocess.run(["scancel", str(jid)], env=env)
            raise _cluster_report(f"job {jid} ({job.get('JobState')}): the Slurm daemon(s) "
                                  f"{', '.join(dead)} died under the job (not a failure of "
                                  "setdiff-dist; restart the cluster: bash "
                                  f"{CLUSTER} stop; bash {CLUSTER} start 3)")
        time.sleep(0.5)
    subprocess.run(["scancel", str(jid)], env=env)
    raise _cluster_report(f"job {jid} did not finish in {timeout} s: {_job(jid, env)}")


def _sbatch(env, log, *args):
    res = subprocess.run(["sbatch", "--parsable", f"--output={log}", *args],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip().split(";")[0])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return sonnet_shards(tmp_path_factory.mktemp("slurm-data"))


def train_args(run_dir, shards, steps):
    # 8 micro-batches of accumulation per step slow the tiny model down enough (~0.15 s a step)
    # that a signal sent at step 3 lands well before the end
    return ["--config", "configs/tiny-cpu.yaml", f"run_dir={run_dir}",
            f"data.train_shards={shards}", "data.seq_len=32", "model.vocab_size=257",
            f"train.steps={steps}", "train.log_interval=1", "data.global_batch_size=16",
            "data.micro_batch_size=1", "optimizer.warmup_steps=2",
            "optimizer.schedule=constant", "train.tensorboard=false", "train.eval_batches=1"]


STEPS = 60


@pytest.fixture(scope="module")
def uninterrupted(cluster, shards, tmp_path_factory):
    """A 2-node job (one rank per emulated node) through the real sbatch script."""
    d = tmp_path_factory.mktemp("slurm-straight")
    jid = _sbatch(cluster, d / "job.out", "--nodes=2", "--ntasks-per-node=1", TRAIN,
                  *train_args(d / "run", shards, STEPS))
    return d, jid, _wait(jid, cluster)


def test_a_two_node_job_trains_and_writes_a_checkpoint(uninterrupted):
    d, jid, job = uninterrupted
    log = (d / "job.out").read_text()
    assert job["JobState"] == "COMPLETED", log[-3000:]
    assert job["NumNodes"] == "2" and job["NodeList"] == "n[1-2]"
    assert "2 node(s) x 1 rank(s), rendezvous n1:" in log
    status = json.loads((d / "run" / "exit_status.json").read_text())
    assert status["outcome"] == "completed" and status["step"] == STEPS
    ckpt = status["checkpoint"]
    manifest = json.loads(open(os.path.join(ckpt, "manifest.json")).read())
    assert manifest["step"] == STEPS
    # one RNG state and one ZeRO shard per rank: the world really was two processes
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("rng")) == \
        ["rng_rank0.pt", "rng_rank1.pt"]
    assert manifest["layout"] == {"tensor": 1, "pipeline": 1, "data": 2, "world": 2,
                                  "context": 1}
    assert sorted(losses(d / "run")) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_preempted_job_checkpoints_requeues_and_ends_like_an_uninterrupted_one(
        uninterrupted, cluster, shards, tmp_path):
    _, _, straight_job = uninterrupted
    assert straight_job["JobState"] == "COMPLETED"
    run = tmp_path / "run"
    jid = _sbatch(cluster, tmp_path / "job.out", "--nodes=2", "--ntasks-per-node=1", TRAIN,
                  *train_args(run, shards, STEPS))
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and len(losses(run)) >= 3):
        assert time.time() < deadline and _job(jid, cluster).get("JobState") not in DONE, \
            "the job ended or stalled before it could be signalled"
        time.sleep(0.1)
    # what --signal=B:USR1@N does before the time limit: SIGUSR1 to the batch shell only
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(jid)], check=True, env=cluster)
    job = _wait(jid, cluster)
    log = (tmp_path / "job.out").read_text()
    assert job["JobState"] == "COMPLETED", log[-3000:]
    assert job["Restarts"] == "1", log[-3000:]
    assert "trainer outcome: preempted" in log and "requeueing job" in log
    resumed = [line for line in log.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1
    stopped_at = int(resumed[0].rsplit(" ", 1)[1])
    assert 3 <= stopped_at < STEPS
    # the same steps, and the same losses bit for bit, as the job that was never interrupted
    assert losses(run) == losses(uninterrupted[0] / "run")
    assert json.loads((run / "exit_status.json").read_text())["step"] == STEPS


def test_sharded_evaluation_and_generation_jobs(uninterrupted, cluster, tmp_path):
    """The checkpoint of the 2-node job, evaluated and sampled at TP=2 through infer.sbatch; the
    TP=2 perplexity bound equals the one a single process computes."""
    d, _, job = uninterrupted
    assert job["JobState"] == "COMPLETED"
    out = tmp_path / "ppl.json"
    eval_job = _sbatch(cluster, tmp_path / "eval.out", INFER, "eval", "--checkpoint",
                       str(d / "run"), "--task", "ppl", "--batches", "2", "--batch-size", "4",
                       "--tensor-parallel", "2", "--out", str(out))
    gen_job = _sbatch(cluster, tmp_path / "gen.out", INFER, "generate", "--checkpoint",
                      str(d / "run"), "--prompt", "Shall I compare thee", "--max-new-tokens",
                      "8", "--window", "1", "--greedy", "--tensor-parallel", "2", "--json")
    for jid, log in ((eval_job, "eval.out"), (gen_job, "gen.out")):
        assert _wait(jid, cluster)["JobState"] == "COMPLETED", \
            (tmp_path / log).read_text()[-3000:]
    assert "1 node(s) x 2 rank(s)" in (tmp_path / "eval.out").read_text()
    sharded = json.loads(out.read_text())
    single = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.eval", "--checkpoint",
                             str(d / "run"), "--task", "ppl", "--batches", "2", "--batch-size",
                             "4", "--out", str(tmp_path / "ppl1.json")],
                            capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-2000:]
    reference = json.loads((tmp_path / "ppl1.json").read_text())
    assert sharded["ppl_bound"] == pytest.approx(reference["ppl_bound"], rel=1e-5)
    generated = [json.loads(line) for line in (tmp_path / "gen.out").read_text().splitlines()
                 if line.startswith("{")]
    assert len(generated) == 1 and len(generated[0]["tokens"][0]) == 8


def _victim(run, jid, env, node):
    """The pid of the rank on ``node`` (from its heartbeat), once the run has a checkpoint."""
    deadline = time.time() + 180
    while True:
        assert time.time() < deadline and _job(jid, env).get("JobState") not in DONE, \
            "the job ended or stalled before a rank could be killed"
        if (run / "checkpoints" / "latest").exists():
            for name in (os.listdir(run / "watchdog") if (run / "watchdog").is_dir() else []):
                try:
                    beat = json.loads((run / "watchdog" / name).read_text())
                except (OSError, ValueError):
                    continue
                if name.startswith("rank") and beat.get("node") == node:
                    return beat["pid"]
        time.sleep(0.1)


def _faulted_job(cluster, shards, tmp_path, node, fault):
    """A 2-node job with train.max_restarts=1, a checkpoint every 10 steps, and ``fault``
    done to ``node`` after the first checkpoint: (its final record, its log)."""
    run = tmp_path / "run"
    jid = _sbatch(cluster, tmp_path / "job.out", "--nodes=2", "--ntasks-per-node=1", TRAIN,
                  *train_args(run, shards, STEPS), "train.max_restarts=1",
                  "checkpoint.interval=10")
    fault(_victim(run, jid, cluster, node))
    job = _wait(jid, cluster)
    return job, (tmp_path / "job.out").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("node", ["n1", "n2"], ids=["batch-node", "other-node"])
def test_a_killed_rank_restarts_inside_the_job(uninterrupted, cluster, shards, tmp_path, node):
    """SIGKILL one rank after the step-10 checkpoint (on n1, which also holds the batch script,
    the rendezvous and rank 0; or on n2): torch elastic's agents restart both ranks in the same
    allocation (the same job, never requeued, no node excluded), they resume from the
    checkpoint, the log says how long the restart took, and the losses are the uninterrupted
    job's, bit for bit."""
    import signal

    _, _, straight_job = uninterrupted
    assert straight_job["JobState"] == "COMPLETED"
    job, log = _faulted_job(cluster, shards, tmp_path, node,
                            lambda pid: os.kill(pid, signal.SIGKILL))
    assert job["JobState"] == "COMPLETED", log[-3000:]
    assert job["Restarts"] == "0" and job["ExcNodeList"] == "(null)", (job, log[-3000:])
    assert job["NodeList"] == "n[1-2]", job
    resumed = [line for line in log.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1 and int(resumed[0].rsplit(" ", 1)[1]) >= 10, log[-3000:]
    assert re.search(r"^restart 1: step \d+ done [\d.]+ s after the previous start's last step",
                     log, re.M), log[-3000:]
    assert losses(tmp_path / "run") == losses(uninterrupted[0] / "run")


@pytest.mark.slow
@pytest.mark.parametrize("node", ["n1", "n2"], ids=["batch-node", "other-node"])
def test_a_lost_node_is_requeued_by_slurm_and_resumes_exactly(uninterrupted, cluster, shards,
                                                              tmp_path, node):
    """The node vanishes after the step-10 checkpoint (cluster.sh kill-node: its slurmd, the
    job's processes on it, the batch script too when it is n1): Slurm ends the job NODE_FAIL
    and requeues it on the nodes that answer; it resumes from the checkpoint, records the
    requeue in faults.jsonl, and ends with the uninterrupted job's losses, bit for bit. The
    surviving agent, which waits for its lost peer, is ended at Slurm's SIGTERM, not after
    KillWait (faults.jsonl records that too)."""
    _, _, straight_job = uninterrupted
    assert straight_job["JobState"] == "COMPLETED"
    try:
        job, log = _faulted_job(
            cluster, shards, tmp_path, node,
            lambda pid: subprocess.run(["bash", CLUSTER, "kill-node", node], check=True,
                                       capture_output=True))
    finally:
        subprocess.run(["bash", CLUSTER, "revive", node], capture_output=True, env=cluster)
    assert job["JobState"] == "COMPLETED", log[-3000:]
    assert job["Restarts"] == "1" and node not in job["NodeList"], (job, log[-3000:])
    faults = [json.loads(line) for line in
              (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    # the survivor's agent.sh records its end in faults.jsonl (its log line goes through srun,
    # which the ending step can take down first: CI lost it once under load)
    ended = [f["node"] for f in faults if f["kind"] == "agent-ended"]
    assert [f["kind"] for f in faults if f["kind"] != "agent-ended"] == ["requeued-by-slurm"] \
        and faults[-1]["kind"] == "requeued-by-slurm", faults
    if node == "n2":  # the surviving agent, on the batch node, did not wait out KillWait
        assert ended == ["n1"], faults
    else:  # the survivor on n2 may have ended before the SIGTERM: its store was on n1
        assert ended in ([], ["n2"]), faults
    assert re.search(r"^requeue 1: step \d+ done [\d.]+ s after the previous start's last step",
                     log, re.M), log[-3000:]
    assert losses(tmp_path / "run") == losses(uninterrupted[0] / "run")
