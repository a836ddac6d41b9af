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
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "shuffle": self.shuffle, "samples": len(self.blend), "order": ORDER,
                "corpora": self.blend.identity()}

    def load_state_dict(self, state: dict) -> None:
        ours = self.state_dict()
        if state.get("order") != ORDER:
            raise ShardError("cannot resume the data stream exactly: the checkpoint's samples "
                             "were ordered by an earlier version of the loader; start a new "
                             "run from its weights (checkpoint.init_from=CHECKPOINT, new run_dir)")
        for key in ("seed", "global_batch", "shuffle", "samples", "corpora"):
            if state.get(key) != ours[key]:
                raise ShardError(f"cannot resume the data stream: the checkpoint has {key}="
                                 f"{state.get(key)!r}, this run has {ours[key]!r}")
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
