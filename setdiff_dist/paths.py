"""Paths read from files (shard manifests, checkpoint manifests, HF indexes) stay inside the
directory that holds them: a manifest cannot make a reader open, or a writer write, anywhere
else."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str) -> str:
    """The SHA-256 of a file, read in 8 MiB blocks (about 1 GB/s on one core)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def inside(directory: str, name: str, what: str, error: type = ValueError) -> str:
    """``directory/name`` if ``name`` is a relative path that resolves (symlinks followed)
    inside ``directory``; ``error`` naming ``what`` otherwise."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise error(f"{what} {name!r} in {directory} is not a relative file name: refused (a "
                    "manifest names files inside its own directory)")
    base = os.path.realpath(directory)
    if os.path.commonpath([base, os.path.realpath(os.path.join(base, name))]) != base:
        raise error(f"{what} {name!r} points outside {directory}: refused (a manifest names "
                    "files inside its own directory)")
    return os.path.join(directory, name)
