"""Shared test set-up: tests run from the repository root, so config paths read as in the README;
one shard set and a cache of trained runs serve the whole session."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _repository_root():
    old = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(old)


@pytest.fixture(scope="session")
def sonnets(tmp_path_factory):
    """The sonnets as shards (bytes tokenizer, L = 32, a valid split), made once a session."""
    from helpers import sonnet_shards

    return sonnet_shards(tmp_path_factory.mktemp("sonnets"))


# The reference run that tests share: the tiny model on the sonnets, 6 steps on 2 ranks (ZeRO-1),
# checkpoints at steps 3 and 6 (helpers.train_command's settings otherwise).
REFERENCE_STEPS = 6
REFERENCE = ("checkpoint.interval=3",)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, sonnets):
    """``trained(*overrides, nproc=2)`` -> the run directory of the reference run with those
    overrides, trained once per distinct configuration in the session and shared: a test that
    changes the run works on ``helpers.copy_run(run, tmp_path)``."""
    from helpers import run_train

    cache = {}

    def get(*overrides, nproc=2):
        key = (tuple(overrides), nproc)
        if key not in cache:
            run = tmp_path_factory.mktemp("trained")
            res = run_train(run, sonnets, *REFERENCE, *overrides, nproc=nproc,
                            steps=REFERENCE_STEPS)
            assert res.returncode == 0, res.stderr[-3000:]
            cache[key] = run
        return cache[key]

    return get
