"""What tests/gpu/run.sh relies on, checked on the CPU: the carried wheel set's check, and that
a test process inside a process group still launches setdiff-train with its own ranks.

The full rehearsal (a stand-in for the GPU machine's Python, the carried wheels installed as
run.sh installs them, the smoke stage on the CPU) is ``bash tests/gpu/run.sh --cpu-rehearsal``,
which .ci/run runs."""

import os
import subprocess
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

import wheelset  # noqa: E402


def _wheel(folder, name, version, requires=(), tag="py3-none-any"):
    """A minimal wheel: enough METADATA for the check."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n\nlong description\n")
    return path


@pytest.fixture
def carried(tmp_path):
    """A folder holding exactly carry.txt's pins; deepspeed needs pydantic (carried) and numpy
    (on the machine), pydantic's test extra is ignored."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    requires = {"deepspeed": ["pydantic>=2", "numpy", "torch"],
                "pydantic": ["pydantic-core==2.50.5", 'pytest; extra == "test"']}
    for name, version in wheelset.carry_pins().items():
        tag = "cp312-cp312-manylinux_2_28_x86_64" if name == "pydantic-core" else "py3-none-any"
        _wheel(folder, name, version, requires.get(name, ()), tag)
    return folder


def _check(folder, python="3.12"):
    return subprocess.run([sys.executable, "tests/gpu/wheelset.py", "check", "--wheels",
                           str(folder), "--python", python], capture_output=True, text=True)


def test_the_pinned_set_passes(carried):
    res = _check(carried)
    assert res.returncode == 0, res.stderr
    assert "every dependency carried or on the GPU machine" in res.stdout


def test_a_missing_wheel_is_named_with_the_fix(carried):
    next(carried.glob("hjson-*.whl")).unlink()
    res = _check(carried)
    assert res.returncode == 2
    assert "missing wheel: hjson==3.1.0" in res.stderr and "fetch_wheels.sh" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_second_version_a_shadowing_copy_and_a_wrong_python_are_refused(carried):
    _wheel(carried, "webdataset", "0.2.100")
    _wheel(carried, "numpy", "2.4.6", tag="cp312-cp312-manylinux_2_28_x86_64")
    res = _check(carried, python="3.11")
    assert res.returncode == 2
    assert "two wheels of webdataset" in res.stderr
    assert "numpy should not be carried (the GPU machine already has it" in res.stderr
    assert "does not install on CPython 3.11" in res.stderr  # the cp312 pydantic-core


def test_a_dependency_that_nobody_provides_is_named(carried):
    next(carried.glob("deepspeed-*.whl")).unlink()
    _wheel(carried, "deepspeed", "0.19.8", ["pydantic>=2", "not-on-the-machine>=1"])
    res = _check(carried)
    assert res.returncode == 2
    assert "needs not-on-the-machine, which is neither carried nor on the GPU machine" \
        in res.stderr


def test_what_the_machine_must_provide_comes_from_setup_and_the_wheels(carried):
    need = wheelset.machine_requirements(str(carried), "3.12")
    assert {"numpy", "safetensors", "tokenizers", "pytest"} <= set(need)
    assert not set(need) & set(wheelset.carry_pins()) and "torch" not in need
    assert set(need) <= wheelset.machine_packages()


@pytest.mark.multiprocess
def test_run_train_from_inside_a_process_group_launches_its_own_ranks(tmp_path):
    """The GPU tests join a process group in the pytest process (RANK, WORLD_SIZE and
    MASTER_PORT land in os.environ); setdiff-train started from there must still start its own
    two ranks on a port of its own, not take itself for rank 0 of the test's group."""
    from helpers import losses, process_group, run_train, sonnet_shards

    shards = sonnet_shards(tmp_path / "data")
    before = dict(os.environ)
    with process_group("gloo"):
        assert os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" in os.environ
        res = run_train(tmp_path / "run", shards, steps=2, nproc=2)
    assert dict(os.environ) == before  # the group's variables are gone again
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    ckpt = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" /
                                                "latest").read_text().strip()
    assert sorted(p.name for p in ckpt.glob("rng_rank*.pt")) == ["rng_rank0.pt",
                                                                   "rng_rank1.pt"]


def test_the_carried_pins_are_the_versions_ci_tests_with():
    import importlib.metadata as md

    for name, version in wheelset.carry_pins().items():
        assert md.version(name) == version, f"{name}: carried {version}, here {md.version(name)}"


def test_a_stage_that_runs_out_of_budget_is_skipped_and_never_a_failure(tmp_path):
    """run.sh's stages end ok, FAILED or skipped (budget), distinctly: past its time limit, or
    a benchmark's own budget skip (exit 3), a stage is skipped and the run still passes; any
    other exit, a kill before the limit included (the OOM killer's SIGKILL), is a failure."""
    script = f"""
        OUT={tmp_path}; failed=0; skipped=""; : > "$OUT/summary.txt"
        source tests/gpu/stages.sh
        stage fine 10 true
        stage over 1 sleep 30
        stage own 10 bash -c 'echo "RESULT: 110m done, 1.3b skipped"; exit 3'
        echo "after skips: failed=$failed skipped=$skipped"
        stage broken 10 bash -c 'exit 1'
        stage killed 10 bash -c 'kill -9 $$'
        echo "after failures: failed=$failed"
    """
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("[gpu] fine: ok in")
    assert lines[1].startswith("[gpu] over: skipped (budget: past its 1 s limit) after")
    assert lines[2].startswith("[gpu] own: skipped (budget: its own budget) after")
    assert lines[2].endswith(": 110m done, 1.3b skipped")
    assert "after skips: failed=0 skipped= over own" in res.stdout
    assert lines[3].startswith("[gpu] broken: FAILED (exit 1)")
    assert lines[4].startswith("[gpu] killed: FAILED (exit 137)")
    assert "after failures: failed=1" in res.stdout


def test_the_bench_stage_exits_3_when_its_budget_skips_a_run(tmp_path):
    """benchmarks/train_throughput.py: a run its --budget-s leaves out is "skipped (budget)"
    and exit 3 (run.sh: skipped, not FAILED); it times what training picks for each order."""
    out = tmp_path / "t.json"
    res = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--models", "110m",
                          "--budget-s", "0", "--json", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 3, res.stdout + res.stderr[-2000:]
    assert "skipped (budget): 110m/causal, 110m/staggered" in res.stdout
    import json

    got = json.loads(out.read_text())
    assert got["args"]["backend"] == "auto" and all("skipped" in r for r in
                                                    got["results"].values())


def test_the_whole_script_keeps_to_its_budget(tmp_path):
    """budgeted: a stage's limit is cut to what is left of the script's budget (less the 15 s
    a kill may take), and a stage with no time left is skipped without running; both are
    budget skips, never failures."""
    script = f"""
        OUT={tmp_path}; failed=0; skipped=""; : > "$OUT/summary.txt"
        source tests/gpu/stages.sh
        start=$(date +%s); TOTAL_S=19; MIN_STAGE_S=1
        budgeted first 100 sleep 30
        budgeted second 10 touch {tmp_path}/ran
        echo "failed=$failed skipped=$skipped"
    """
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("[gpu] first: skipped (budget: past its 4 s limit) after 4 s")
    assert lines[1].startswith("[gpu] second: skipped (budget: ") and "of the script's 19 s" \
        in lines[1]
    assert not (tmp_path / "ran").exists()
    assert "failed=0 skipped= first second" in res.stdout
