"""Blended corpora: several shard directories sampled in fixed proportions, as Megatron's
``--data-path 0.3 A 0.7 B``.

``data.train_shards: "0.3 data/web 0.7 data/books"`` (weights need not sum to 1; one directory
alone needs no weight). The stream of sample positions is cut into blocks of
:data:`BLOCK` positions; within each block corpus ``d`` gets ``round(w_d * BLOCK)`` positions
(largest remainders, so that they add up), spread evenly by the greedy rule Megatron's
``BlendedDataset`` uses (each next position goes to the corpus furthest behind its share). So
over any window of 10,000 positions each corpus's share is within a sample or two of its weight,
and a position maps to ``(corpus, k)``, the ``k``-th sample of that corpus's own stream, in O(1):
no index the size of the dataset is built. Each corpus goes through its own epochs (a small
corpus with a large weight is repeated more often), each shuffled by its own seeded
:class:`~setdiff_dist.data.permutation.Permutation`.

Every corpus must hold the run's sequence length and tokenizer; the first one's tokenizer is the
run's.
"""

from __future__ import annotations

import math
import os
from typing import Optional

from .shards import MAX_OPEN, ShardError, ShardSet

BLOCK = 10_000  # stream positions per block of the blend


def parse_blend(spec: str) -> list[tuple[float, str]]:
    """``"DIR"`` -> ``[(1.0, DIR)]``; ``"0.3 A 0.7 B"`` -> ``[(0.3, A), (0.7, B)]``, normalized.
    Raises :class:`ShardError` naming what is wrong."""
    parts = spec.split()
    if not parts:
        raise ShardError("no shard directory given (data.train_shards): run setdiff-prep "
                         "--out DIR and set data.train_shards=DIR")
    if len(parts) == 1:
        return [(1.0, parts[0])]
    if len(parts) % 2:
        raise ShardError(f"shards {spec!r}: a blend is weight-directory pairs, e.g. "
                         "'0.3 data/web 0.7 data/books' (one directory alone needs no weight)")
    pairs = []
    for w, d in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ShardError(f"shards {spec!r}: {w!r} is not a weight; a blend is "
                             "weight-directory pairs, e.g. '0.3 data/web 0.7 data/books'") from None
        if not (math.isfinite(weight) and weight > 0):
            raise ShardError(f"shards {spec!r}: the weight of {d} is {w}; weights must be "
                             "positive numbers")
        pairs.append((weight, d))
    total = sum(w for w, _ in pairs)
    return [(w / total, d) for w, d in pairs]


def _block_counts(weights: list[float]) -> list[int]:
    """Positions per block for each corpus: largest remainders of ``w * BLOCK``; every corpus
    gets at least one."""
    raw = [w * BLOCK for w in weights]
    counts = [max(1, math.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - math.floor(raw[i]), reverse=True)
    i = 0
    while sum(counts) < BLOCK:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > BLOCK:  # (only when tiny weights were raised to 1)
        big = max(range(len(counts)), key=lambda j: counts[j])
        counts[big] -= 1
    return counts


class Blend:
    """The corpora of a run's split: ``locate(position) -> (corpus, k)``."""

    def __init__(self, sets: list[ShardSet], weights: list[float], specs: list[str]):
        total = sum(weights)
        self.sets, self.weights, self.specs = sets, [w / total for w in weights], specs
        self.counts = _block_counts(self.weights)
        # within a block: which corpus each position goes to, and its rank among that corpus's
        # (one corpus needs no table: locate is the identity)
        which, rank, taken = [], [], [0] * len(sets)
        for o in range(BLOCK if len(sets) > 1 else 0):
            d = max(range(len(sets)), key=lambda j: self.counts[j] * (o + 1) / BLOCK - taken[j])
            which.append(d)
            rank.append(taken[d])
            taken[d] += 1
        self._which, self._rank = which, rank

    @classmethod
    def open(cls, spec: str, split: str, *, seq_len: Optional[int] = None,
             tokenizer_sha256: Optional[str] = None, verify: str = "size",
             max_open: int = MAX_OPEN) -> "Blend":
        """Open every corpus of ``spec`` (see :func:`parse_blend`), each checked against the
        sequence length and the tokenizer (the first corpus's, unless given)."""
        pairs = parse_blend(spec)
        sets = []
        for _, directory in pairs:
            s = ShardSet(directory, split, seq_len=seq_len, tokenizer_sha256=tokenizer_sha256,
                         verify=verify, max_open=max_open)
            if tokenizer_sha256 is None:
                tokenizer_sha256 = s.manifest["tokenizer"]["sha256"]
            sets.append(s)
        return cls(sets, [w for w, _ in pairs], [d for _, d in pairs])

    @classmethod
    def single(cls, shards: ShardSet) -> "Blend":
        return cls([shards], [1.0], [shards.directory])

    @property
    def manifest(self) -> dict:
        """The first corpus's manifest (its tokenizer is the run's)."""
        return self.sets[0].manifest

    @property
    def directory(self) -> str:
        """The first corpus's directory (where the run's tokenizer file is)."""
        return self.sets[0].directory

    def locate(self, position: int) -> tuple[int, int]:
        """Stream position -> (corpus, position in that corpus's own stream)."""
        if len(self.sets) == 1:
            return 0, position
        block, o = divmod(position, BLOCK)
        d = self._which[o]
        return d, block * self.counts[d] + self._rank[o]

    def identity(self) -> list[dict]:
        """What a checkpoint records of the blend, to refuse resuming on other data."""
        return [{"corpus": os.path.basename(os.path.normpath(d)), "weight": round(w, 12),
                 "samples": len(s)} for d, w, s in zip(self.specs, self.weights, self.sets)]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sets)
