"""Shared test set-up: tests run from the repository root, so config paths read as in the README;
shard sets and trained runs are made once per session and shared (``shards_of``, ``sonnets``,
``trained``): a test that changes a run works on a copy (``helpers.copy_run``,
``helpers.rewound``)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One CPU thread per process unless the caller says otherwise, as torchrun gives its ranks: a
# session starts many processes (gloo ranks, commands) on a few cores, where the OpenMP threads
# of several processes stall one another (CI's layer-plan tests ran 5-40x slower than alone;
# under two busy loops here, 1.6x slower with 2 threads than with 1). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# No hub from the tests (this machine has none): datasets and transformers read local files only,
# and their caches live in a directory of the session's own, not in the user's home. Set before
# anything imports them (they read these at import).
for _key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_key, "1")
if "HF_HOME" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="setdiff-tests-hf-")
    atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)


@pytest.fixture(autouse=True, scope="session")
def _repository_root():
    old = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(old)


@pytest.fixture(autouse=True)
def _no_launch_variables_leak():
    """A test that joins a process group in this process (init_distributed sets RANK,
    MASTER_PORT...) must not leave them to the next one: a child started later would take
    itself for a rank of a group that is gone."""
    from helpers import LAUNCH_VARIABLES

    before = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def shards_of(tmp_path_factory):
    """``shards_of(tokenizer="bytes")``: the sonnets as shards (L = 32, a valid split of every
    fourth stanza) with that tokenizer, made once a session."""
    from helpers import sonnet_shards

    made = {}

    def get(tokenizer="bytes"):
        if tokenizer not in made:
            made[tokenizer] = sonnet_shards(tmp_path_factory.mktemp("sonnets"), tokenizer)
        return made[tokenizer]

    return get


@pytest.fixture(scope="session")
def sonnets(shards_of):
    """The sonnets as byte-level shards (``shards_of("bytes")``)."""
    return shards_of("bytes")


@pytest.fixture(scope="session")
def trained(tmp_path_factory, shards_of):
    """``trained(*overrides, nproc=2, tokenizer="bytes")`` -> the run directory of the
    session's reference run with those overrides: the tiny model on the sonnets, the same steps
    and schedule for every one (``helpers.REFERENCE_STEPS`` steps, checkpoints every
    ``REFERENCE_INTERVAL``; helpers.train_command's settings otherwise), trained once per
    distinct configuration and shared. Tests copy it before changing it."""
    from helpers import REFERENCE, REFERENCE_STEPS, VOCAB, noise, run_train

    cache = {}

    def get(*overrides, nproc=2, tokenizer="bytes"):
        key = (tuple(overrides), nproc, tokenizer)
        if key not in cache:
            run = tmp_path_factory.mktemp("trained")
            res = run_train(run, shards_of(tokenizer), *REFERENCE, *overrides, nproc=nproc,
                            steps=REFERENCE_STEPS, vocab=VOCAB[tokenizer])
            assert res.returncode == 0, res.stderr[-3000:]
            # every shared run is also a check that setdiff-train is quiet on its ranks
            assert not noise(res.stderr), (overrides, res.stderr[-3000:])
            cache[key] = run
        return cache[key]

    return get


@pytest.fixture(scope="session")
def layouts(sonnets, tmp_path_factory):
    """Every layout of ``helpers.LAYOUTS`` trained once a session, in-process, one spawn per
    world size: ``({name: (losses, validation rows) or (error, message)}, {name: stderr},
    the directory of their run dirs)``."""
    from helpers import run_layouts

    root = tmp_path_factory.mktemp("layouts")
    return (*run_layouts(sonnets, root), root)
