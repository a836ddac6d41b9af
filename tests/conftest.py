"""Shared test set-up: tests run from the repository root, so config paths read as in the README."""

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
