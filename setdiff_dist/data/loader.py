"""Per-rank micro-batches from a :class:`~setdiff_dist.data.shards.ShardSet` or a
:class:`~setdiff_dist.data.blend.Blend` of several, resumable exactly.

The order is global and deterministic: a stream position goes to a corpus of the blend and to
the next position of that corpus's own stream (:meth:`Blend.locate`); epoch ``e`` of a corpus
is a permutation of its samples seeded by ``(seed, corpus, e)``, computed per sample in O(1)
memory (:class:`~setdiff_dist.data.permutation.Permutation`); optimizer step ``k`` consumes
stream positions ``[k G, (k + 1) G)``, of which
data-parallel rank ``r`` takes a contiguous ``G / D``, in micro-batches. The step is the whole
state: resuming at step ``k`` yields exactly the batches an uninterrupted run would have seen,
whatever the number of loader workers. A sample's stream position is its *global sample index*,
from which its order and noise are seeded (docs/method.md §4), so those do not depend on the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from setdiff_dist.diffusion.orders import sample_seed

from .blend import SCHEME as BLEND_SCHEME
from .blend import Blend
from .permutation import Permutation
from .shards import ShardError, ShardSet

ORDER = "feistel/1"  # how stream positions map to samples; a checkpoint records it


@dataclass
class Batch:
    """A micro-batch: token ids, padding and context masks, and the global sample indices."""

    tokens: torch.Tensor    # [b, L] long
    padding: torch.Tensor   # [b, L] bool
    context: torch.Tensor   # [b, L] bool
    indices: torch.Tensor   # [b] long: positions in the global sample stream

    def to(self, device) -> "Batch":
        return Batch(**{k: v.to(device) for k, v in self.__dict__.items()})

    @staticmethod
    def pack(batches: list["Batch"]) -> torch.Tensor:
        """Micro-batches of one shape as one flat int64 tensor (one broadcast sends a step)."""
        return torch.cat([torch.cat([b.tokens.flatten(), b.padding.flatten().long(),
                                     b.context.flatten().long(), b.indices]) for b in batches])

    @staticmethod
    def unpack(flat: torch.Tensor, n: int, b: int, L: int) -> list["Batch"]:
        """The inverse of :meth:`pack` for ``n`` micro-batches of ``b`` sequences of ``L``."""
        out = []
        for chunk in flat.split(3 * b * L + b):
            tokens, padding, context, indices = chunk.split([b * L, b * L, b * L, b])
            out.append(Batch(tokens=tokens.view(b, L), padding=padding.view(b, L).bool(),
                             context=context.view(b, L).bool(), indices=indices))
        assert len(out) == n
        return out

    @staticmethod
    def packed_size(n: int, b: int, L: int) -> int:
        return n * (3 * b * L + b)


class _StreamSamples(torch.utils.data.Dataset):
    """Stream position -> (corpus, sample), through each corpus's permutation of its epoch."""

    def __init__(self, blend: Blend, seed: int, shuffle: bool):
        self.blend, self.seed, self.shuffle = blend, seed, shuffle
        self._perms: dict = {}  # corpus -> the permutation of its current epoch

    def sample_index(self, position: int) -> tuple[int, int]:
        corpus, k = self.blend.locate(position)
        n = len(self.blend.sets[corpus])
        epoch, offset = divmod(k, n)
        if not self.shuffle:
            return corpus, offset
        perm = self._perms.get(corpus)
        if perm is None or perm[0] != epoch:
            seed = sample_seed(self.seed, corpus, stream=0x5A4D)
            perm = self._perms[corpus] = (epoch, Permutation(n, seed, epoch))
        return corpus, perm[1][offset]

    def __getitem__(self, position: int):
        corpus, i = self.sample_index(position)
        tokens, length, context = self.blend.sets[corpus][i]
        return tokens, length, context, position


def _collate(items) -> Batch:
    tokens = torch.from_numpy(np.stack([t for t, _, _, _ in items]).astype(np.int64))
    L = tokens.shape[1]
    pos = torch.arange(L)
    length = torch.tensor([n for _, n, _, _ in items])
    context = torch.tensor([c for _, _, c, _ in items])
    return Batch(tokens=tokens, padding=pos >= length[:, None], context=pos < context[:, None],
                 indices=torch.tensor([p for _, _, _, p in items]))


class _RankBatches:
    """The micro-batches of stream positions of one data-parallel rank, from a start step."""

    def __init__(self, global_batch, micro_batch, dp_rank, dp_size, start_step):
        self.G, self.mb, self.rank, self.D, self.start = (global_batch, micro_batch, dp_rank,
                                                          dp_size, start_step)

    def __iter__(self):
        per_rank = self.G // self.D
        step = self.start
        while True:
            base = step * self.G + self.rank * per_rank
            for m in range(per_rank // self.mb):
                yield list(range(base + m * self.mb, base + (m + 1) * self.mb))
            step += 1


def _from_worker(exc: ShardError) -> ShardError:
    """A shard error as its reader raised it: a loader worker's comes back wrapped in the
    worker's traceback text, which is no message for a user."""
    text = str(exc)
    mark = "Original Traceback (most recent call last):"
    if mark in text:
        name = f"{type(exc).__module__}.{type(exc).__qualname__}: "
        tail = text[text.index(mark):]
        text = tail[tail.index(name) + len(name):].strip() if name in tail else \
            tail.strip().splitlines()[-1]
    return ShardError(text, every_rank=False)  # (one rank's data: that rank reports it)


def fixed_batches(shards: ShardSet | Blend, samples: int, micro_batch: int, dp_rank: int = 0,
                  dp_size: int = 1) -> list[Batch]:
    """The first ``samples`` samples of ``shards`` in stream order (unshuffled): a validation
    set that does not depend on the layout. Data-parallel rank ``r`` takes the ``r``-th of
    ``dp_size`` contiguous parts of ``ceil(samples / dp_size)`` positions, in micro-batches of
    ``micro_batch``; positions past ``samples`` are empty samples (no target),
    so every rank runs the same number of micro-batches and each sample counts once. A
    sample's index is its stream position, so the orders seeded by it are the same on every
    layout too."""
    blend = shards if isinstance(shards, Blend) else Blend.single(shards)
    samples = min(samples, len(blend))
    per_rank = -(-samples // dp_size)
    lo = dp_rank * per_rank
    stream = _StreamSamples(blend, seed=0, shuffle=False)
    L = blend.sets[0].seq_len
    empty = np.zeros(L, dtype=np.int32)
    out = []
    for start in range(lo, lo + per_rank, micro_batch):
        # (an empty sample: one token, the first, which is context and never a target)
        out.append(_collate([stream[p] if p < samples else (empty, 1, 0, p)
                             for p in range(start, start + micro_batch)]))
    return out


def check_stream(saved: dict, ours: dict) -> None:
    """Refuse to resume the data stream of a checkpoint (``saved``: a loader's state) on
    another one (``ours``): another seed, batch, shuffle or ordering, another blend scheme,
    other corpora or weights, or other data under the same names (each corpus's manifest
    digest, which covers every shard's SHA-256)."""
    fresh = ("start a new run from its weights (checkpoint.init_from=CHECKPOINT, new run_dir)")
    if saved.get("order") != ORDER:
        raise ShardError("cannot resume the data stream exactly: the checkpoint's samples "
                         f"were ordered by an earlier version of the loader; {fresh}")
    for key in ("seed", "global_batch", "shuffle", "samples"):
        if saved.get(key) != ours[key]:
            raise ShardError(f"cannot resume the data stream: the checkpoint has {key}="
                             f"{saved.get(key)!r}, this run has {ours[key]!r}")
    mine, theirs = ours["corpora"], saved.get("corpora") or []
    names = [c["corpus"] for c in theirs], [c["corpus"] for c in mine]
    if len(mine) != len(theirs) or names[0] != names[1]:
        raise ShardError(f"cannot resume the data stream: the checkpoint was trained on "
                         f"{', '.join(names[0])}, this run reads {', '.join(names[1])}")
    if len(mine) > 1 and saved.get("blend") != ours.get("blend"):
        earlier = saved.get("blend") or "blocks of 10,000 positions"
        raise ShardError("cannot resume the data stream exactly: the checkpoint's blend was "
                         f"drawn by an earlier scheme ({earlier}), this version draws "
                         f"{ours.get('blend')}; {fresh}")
    for old, new in zip(theirs, mine):
        for key in ("weight", "share", "samples"):
            if key in old and old[key] != new[key]:
                raise ShardError(f"cannot resume the data stream: corpus {new['corpus']} has "
                                 f"{key} {old[key]!r} in the checkpoint, {new[key]!r} in this "
                                 "run")
        if "manifest_sha256" in old and old["manifest_sha256"] != new["manifest_sha256"]:
            raise ShardError(f"cannot resume the data stream: corpus {new['corpus']} holds other "
                             f"data than the checkpoint's (the same name and size, another "
                             f"manifest: sha256 {new['manifest_sha256'][:12]}, the checkpoint's "
                             f"{old['manifest_sha256'][:12]}); point data.train_shards at the "
                             f"shards the run trained on, or {fresh}")


class TokenLoader:
    """Per-rank micro-batches for each optimizer step, resumable at any step.

    ``for micro_batches in loader`` yields, per step, ``G / (D * b)`` :class:`Batch` objects."""

    def __init__(self, shards: ShardSet | Blend, *, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 num_workers: int = 2, start_step: int = 0):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"data.global_batch_size={global_batch} must be a multiple of "
                             f"data.micro_batch_size={micro_batch} x data-parallel size {dp_size}")
        self.blend = shards if isinstance(shards, Blend) else Blend.single(shards)
        self.seed, self.shuffle = seed, shuffle
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.step = start_step
        self.accumulation = global_batch // (micro_batch * dp_size)

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume exactly: the next step and the stream settings."""
        state = {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                 "shuffle": self.shuffle, "samples": len(self.blend), "order": ORDER,
                 "corpora": self.blend.identity()}
        if len(self.blend.sets) > 1:
            state["blend"] = BLEND_SCHEME
        return state

    def load_state_dict(self, state: dict) -> None:
        check_stream(state, self.state_dict())
        self.step = int(state["step"])

    def __iter__(self) -> Iterator[list[Batch]]:
        dataset = _StreamSamples(self.blend, self.seed, self.shuffle)
        sampler = _RankBatches(self.global_batch, self.micro_batch, self.dp_rank, self.dp_size,
                               self.step)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=_collate, num_workers=self.num_workers,
            persistent_workers=False, prefetch_factor=4 if self.num_workers else None)
        it = iter(loader)
        while True:
            try:
                micro = [next(it) for _ in range(self.accumulation)]
            except ShardError as exc:
                raise _from_worker(exc) from None
            self.step += 1
            yield micro
