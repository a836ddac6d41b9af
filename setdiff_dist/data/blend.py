"""Blended corpora: several shard directories sampled in fixed proportions, as Megatron's
``--data-path 0.3 A 0.7 B``.

``data.train_shards: "0.3 data/web 0.7 data/books"`` (weights need not sum to 1; one directory
alone needs no weight). The weights are read as exact decimals and normalized to fractions
``w_d = a_d / P`` with the smallest common denominator ``P``; the stream of sample positions is
cut into periods of ``P`` positions, in each of which corpus ``d`` gets exactly ``a_d``. Within
a period they are spread by Tijdeman's rule for the chairman assignment problem (each position
goes, among the corpora whose next sample is due, to the one with the earliest deadline), which
keeps every corpus's count after *any* ``n`` positions within ``1 - 1/(2K - 2)`` of ``n w_d``
(``K`` corpora): each realized share is within ``1 / n`` of its weight, exactly, for every
``n``. A position maps to ``(corpus, k)``, the ``k``-th sample of that corpus's own stream, in
O(1), through a table of one period (:data:`MAX_PERIOD` positions at most): weights that would
need a longer period (finer than one part in a million of their total) are refused with the
smallest weight and the precision the scheme honours, never rounded. Megatron's
``BlendedDataset`` builds an index as long as the dataset instead.

Each corpus goes through its own epochs (a small corpus with a large weight is repeated more
often), each shuffled by its own seeded :class:`~setdiff_dist.data.permutation.Permutation`.
Every corpus must hold the run's sequence length and tokenizer; the first one's tokenizer is the
run's.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
from fractions import Fraction
from typing import Optional

import numpy as np

from .shards import MANIFEST, MAX_OPEN, ShardError, ShardSet

MAX_PERIOD = 1_000_000  # positions in the longest period a blend's table may need
SCHEME = "tijdeman/1"  # how stream positions map to corpora; a checkpoint records it


def _weight(text: str, spec: str, directory: str) -> Fraction:
    try:
        weight = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ShardError(f"shards {spec!r}: {text!r} is not a weight; a blend is "
                         "weight-directory pairs, e.g. '0.3 data/web 0.7 data/books'") from None
    if not weight > 0:
        raise ShardError(f"shards {spec!r}: the weight of {directory} is {text}; weights must "
                         "be positive numbers")
    return weight


def parse_blend(spec: str) -> list[tuple[Fraction, str]]:
    """``"DIR"`` -> ``[(1, DIR)]``; ``"0.3 A 0.7 B"`` -> ``[(3/10, A), (7/10, B)]``: the
    weights as exact fractions, normalized. Raises :class:`ShardError` naming what is wrong,
    including weights the blend cannot draw exactly (:func:`period`)."""
    parts = spec.split()
    if not parts:
        raise ShardError("no shard directory given (data.train_shards): run setdiff-prep "
                         "--out DIR and set data.train_shards=DIR")
    if len(parts) == 1:
        return [(Fraction(1), parts[0])]
    if len(parts) % 2:
        raise ShardError(f"shards {spec!r}: a blend is weight-directory pairs, e.g. "
                         "'0.3 data/web 0.7 data/books' (one directory alone needs no weight)")
    pairs = [(_weight(w, spec, d), d) for w, d in zip(parts[::2], parts[1::2])]
    total = sum(w for w, _ in pairs)
    pairs = [(w / total, d) for w, d in pairs]
    period([w for w, _ in pairs], spec, [d for _, d in pairs])
    return pairs


def period(shares: list[Fraction], spec: str = "", names: Optional[list[str]] = None) -> int:
    """The positions ``P`` of one period of the blend of normalized ``shares``: the least
    common denominator. A :class:`ShardError` when it exceeds :data:`MAX_PERIOD`, naming the
    smallest share and the precision the scheme can draw exactly."""
    P = 1
    for w in shares:
        P = P * w.denominator // math.gcd(P, w.denominator)
    if P <= MAX_PERIOD:
        return P
    floor = Fraction(1, MAX_PERIOD)
    i = min(range(len(shares)), key=lambda j: shares[j])
    small = ""
    if shares[i] < floor:
        name = names[i] if names else f"corpus {i + 1}"
        small = (f"; {name} has a share of {float(shares[i]):.3g}, below the smallest the "
                 f"blend honours, {float(floor):g}: raise its weight to that or leave it out")
    raise ShardError(
        f"shards {spec!r}: the blend cannot draw these weights exactly: their shares need a "
        f"period of {P:,} samples, more than the {MAX_PERIOD:,} a blend supports. It draws "
        f"shares that are multiples of {float(floor):g} of the total exactly (give weights "
        f"with at most 6 decimal places summing to 1, or whole numbers){small}")


def assignment(counts: list[int]) -> np.ndarray:
    """Which corpus each position of one period goes to, for ``counts[d]`` positions of corpus
    ``d`` (``P = sum(counts)``): Tijdeman's schedule. With ``mu = 1 / (2K - 2)``, the
    ``k``-th sample of corpus ``d`` (share ``w = counts[d] / P``) is released at position
    ``(k + mu) / w`` and due by ``(k + 1 - mu) / w``; each position (1-based) takes the released
    sample with the earliest deadline. Then ``|taken_d(n) - n w_d| <= 1 - mu`` for every prefix
    ``n`` (Tijdeman, 1980). Exact integer arithmetic."""
    K, P = len(counts), sum(counts)
    out = np.empty(P, dtype=np.int16 if K < 2 ** 15 else np.int32)
    if K == 1:
        out[:] = 0
        return out
    m = 2 * K - 2  # mu = 1 / m
    # deadlines ((k + 1) m - 1) / (m c_d) in integer units: x m lcm(c) (exact, fast to compare)
    lcm = 1
    for c in counts:
        lcm = lcm * c // math.gcd(lcm, c)
    unit = [lcm // c for c in counts]
    taken = [0] * K
    waiting = [(_release(0, counts[d], m, P), d) for d in range(K) if counts[d]]
    heapq.heapify(waiting)
    ready: list = []
    for t in range(1, P + 1):
        while waiting and waiting[0][0] <= t:
            _, d = heapq.heappop(waiting)
            heapq.heappush(ready, (((taken[d] + 1) * m - 1) * unit[d], d))
        _, d = heapq.heappop(ready)
        out[t - 1] = d
        taken[d] += 1
        if taken[d] < counts[d]:
            heapq.heappush(waiting, (_release(taken[d], counts[d], m, P), d))
    return out


def _release(k: int, count: int, m: int, P: int) -> int:
    """The first position (1-based) at which the ``k``-th sample of a corpus of ``count`` per
    period ``P`` is released: the least ``t`` with ``t count / P >= k + 1/m``."""
    return max(1, -(-((k * m + 1) * P) // (m * count)))


def manifest_digest(directory: str) -> str:
    """The SHA-256 of a shard directory's manifest, which holds the SHA-256 of every shard: what
    a checkpoint records of each corpus, to refuse resuming on other data."""
    with open(os.path.join(directory, MANIFEST), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class Blend:
    """The corpora of a run's split: ``locate(position) -> (corpus, k)``."""

    def __init__(self, sets: list[ShardSet], weights: list, specs: list[str]):
        """``weights``: numbers or exact fractions (decimal strings are read exactly), any
        positive scale."""
        shares = [Fraction(str(w)) if isinstance(w, float) else Fraction(w) for w in weights]
        total = sum(shares)
        self.sets, self.specs = sets, specs
        self.shares = [w / total for w in shares]
        self.weights = [float(w) for w in self.shares]
        self.period = period(self.shares, " ".join(f"{w} {d}" for w, d in zip(weights, specs)),
                             specs)
        self.counts = [int(w * self.period) for w in self.shares]
        # within a period: which corpus each position goes to, and its rank among that
        # corpus's (one corpus needs no table: locate is the identity)
        if len(sets) > 1:
            self._which = assignment(self.counts)
            self._rank = np.empty(self.period, dtype=np.int64)
            for d in range(len(sets)):
                mine = self._which == d
                self._rank[mine] = np.arange(int(mine.sum()))

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
        cycle, o = divmod(position, self.period)
        d = int(self._which[o])
        return d, cycle * self.counts[d] + int(self._rank[o])

    def identity(self) -> list[dict]:
        """What a checkpoint records of the blend, to refuse resuming on other data: each
        corpus's name, exact share, sample count and the digest of its manifest (which holds
        the SHA-256 of every shard)."""
        return [{"corpus": os.path.basename(os.path.normpath(d)), "weight": round(float(w), 12),
                 "share": str(w), "samples": len(s), "manifest_sha256": manifest_digest(s.directory)}
                for d, w, s in zip(self.specs, self.shares, self.sets)]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sets)
