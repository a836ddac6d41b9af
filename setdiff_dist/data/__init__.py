"""Data: shard reading and writing, tokenizers, and the small built-in sample text."""

from importlib import resources


def sample_text() -> str:
    """A few of Shakespeare's sonnets (public domain): real language for the CPU demo."""
    return resources.files(__package__).joinpath("sonnets.txt").read_text(encoding="utf-8")
