"""The KV cache of committed (clean) tokens, and the decoding step that attends over it.

A clean token's keys and values never change once computed (docs/method.md §3), so the cache is
exact. During a decoding step the model runs on a few *new* tokens (the tokens committed by the
previous step, and [MASK] queries); given a :class:`DecodeStep` as its ``step`` argument, the
lean model's attention (:mod:`setdiff_dist.inference.lean`) attends ``[cache ; new]`` under the
step's mask, writing the new keys and values into the preallocated cache right after its live
prefix; afterwards
:meth:`KVCache.commit` keeps those of the committed tokens only. Each tensor-parallel rank caches
its own heads. Keys are cached after rotary embedding, at each token's own position."""

from __future__ import annotations

from typing import Optional

import torch

INITIAL_CAPACITY = 64  # slots per sample before the first doubling


class KVCache:
    """Per layer a preallocated ``k, v [b, groups, capacity, d]``; the first ``length`` slots hold
    the committed tokens, ``valid [b, length]`` says which slots of each sample are live (ragged
    batches, cropped entries) and ``positions [b, length]`` their positions.

    A step's new keys and values are written in place right after ``length``
    (:func:`attend`), so attention reads one contiguous prefix of the buffer and committing the
    step's leading tokens (the decoders put committed tokens first) only moves ``length``: no
    per-step concatenation of the whole cache. The buffers double when full; slots that
    cropping left dead are squeezed out first."""

    def __init__(self, num_layers: int, batch: int, device, capacity: Optional[int] = None):
        capacity = capacity or INITIAL_CAPACITY
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.batch, self.capacity = batch, capacity
        self._valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self._positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.length = 0

    @property
    def valid(self) -> torch.Tensor:
        return self._valid[:, :self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[:, :self.length]

    # -- room ------------------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Make room for ``n`` new tokens after ``length``."""
        if self.length + n <= self.capacity:
            return
        self._squeeze()
        if self.length + n <= self.capacity:
            return
        self._grow(max(2 * self.capacity, self.length + n))

    def _grow(self, capacity: int) -> None:
        """Enlarge the buffers to ``capacity`` slots per sample (no smaller)."""
        grow = capacity - self.capacity
        if grow <= 0:
            return
        self._each_layer(lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], grow, t.shape[3])],
                                             2))
        self._valid = torch.cat([self._valid, self._valid.new_zeros(self.batch, grow)], 1)
        self._positions = torch.cat([self._positions,
                                     self._positions.new_zeros(self.batch, grow)], 1)
        self.capacity = capacity

    def _each_layer(self, fn) -> None:
        """Replace every allocated layer's keys and values ``t`` by ``fn(t)``."""
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = fn(t)

    def _squeeze(self) -> None:
        """Move each sample's live slots to the front, in order (attention does not depend on
        the order of the keys: positions are in them)."""
        valid = self.valid
        live = int(valid.sum(1).max()) if self.length else 0
        if live == self.length:
            return
        order = torch.sort((~valid).int(), dim=1, stable=True).indices[:, :live]
        self._gather_slots(0, self.length, order)
        self._valid[:, :live] = torch.gather(valid, 1, order)
        self._positions[:, :live] = torch.gather(self.positions, 1, order)
        self.length = live

    def _gather_slots(self, lo: int, width: int, order: torch.Tensor) -> None:
        """In every layer's keys and values, slots ``lo + order[b, j]`` (within ``[lo, lo +
        width)``) move to ``lo + j``, per sample."""
        for store in (self.k, self.v):
            for t in store:
                if t is not None:
                    idx = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                    t[:, :, lo:lo + order.shape[1]] = torch.gather(t[:, :, lo:lo + width], 2, idx)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store a step's new ``k, v [b, g, n, d]`` after the cache; returns the keys and values
        of ``[cache ; new]``."""
        n = k.shape[2]
        if self.k[layer] is None:
            shape = (self.batch, k.shape[1], self.capacity, k.shape[3])
            self.k[layer] = k.new_zeros(shape)
            self.v[layer] = v.new_zeros(shape)
        end = self.length + n
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def commit(self, commit: torch.Tensor, positions: torch.Tensor,
               leading: bool = False) -> None:
        """Keep the keys/values of the step's tokens flagged in ``commit [b, n]``, compacted to
        the largest per-sample count; the others are forgotten. ``leading=True`` is the
        caller's promise that each row's flagged tokens are its first ones and that some row
        flags all ``n`` (no check, no device-to-host sync)."""
        if leading:
            count = commit.shape[1]
        else:
            count = int(commit.sum(1).max()) if commit.numel() else 0
        if count:
            first = commit[:, :count]
            leading = leading or (not bool(commit[:, count:].any()) and
                                  bool((first[:, 1:].int() <= first[:, :-1].int()).all()))
            if not leading:
                # committed tokens are not each row's leading ones: gather them to the front
                order = torch.sort(commit.int(), dim=1, descending=True,
                                   stable=True).indices[:, :count]
                self._gather_slots(self.length, commit.shape[1], order)
                first = torch.gather(commit, 1, order)
                positions = torch.gather(positions, 1, order)
            end = self.length + count
            self._valid[:, self.length:end] = first
            self._positions[:, self.length:end] = positions[:, :count]
            self.length = end

    # -- rows that join and leave (continuous batching) ------------------------------------------
    def add_rows(self, n: int) -> None:
        """Append ``n`` empty rows (samples that join the batch: their prompt goes in as the
        next step's commits)."""
        def grow(t):
            return torch.cat([t, t.new_zeros(n, *t.shape[1:])], 0)

        self._each_layer(grow)
        self._valid, self._positions = grow(self._valid), grow(self._positions)
        self.batch += n

    def append(self, other: "KVCache") -> None:
        """Append ``other``'s rows after this cache's (samples prefilled in a cache of their
        own join the batch); each keeps its slots, and the shorter side's extra slots are dead."""
        length, capacity = max(self.length, other.length), max(self.capacity, other.capacity)
        for cache in (self, other):
            cache._grow(capacity)  # (the same on both sides)
            cache._valid[:, cache.length:length] = False  # (stale flags past a squeeze)
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                if a is None and b is None:
                    continue
                a = a if a is not None else b.new_zeros(self.batch, *b.shape[1:])
                b = b if b is not None else a.new_zeros(other.batch, *a.shape[1:])
                mine[i] = torch.cat([a, b], 0)
        self._valid = torch.cat([self._valid, other._valid], 0)
        self._positions = torch.cat([self._positions, other._positions], 0)
        self.batch, self.length = self.batch + other.batch, length

    def keep_rows(self, rows: list) -> None:
        """Keep only these rows, in this order (samples that finished leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self._valid.device)

        def keep(t):
            return t.index_select(0, index)

        self._each_layer(keep)
        self._valid, self._positions = keep(self._valid), keep(self._positions)
        self.batch = len(rows)
        if not rows:  # an empty batch starts again from an empty buffer
            self.k = [None] * len(self.k)
            self.v = [None] * len(self.v)
            self.length = 0

    def crop(self, keep_last) -> None:
        """Forget all but the ``keep_last`` most recent valid entries of each sample (past the
        model's context); an int, or ``[b, 1]`` per sample."""
        valid = self.valid
        newer = valid.flip(1).cumsum(1).flip(1)  # valid entries at or after each slot
        self._valid[:, :self.length] = valid & (newer <= keep_last)


class DecodeStep:
    """One KV-cached decoding step, handed to the model as its ``step`` argument (as gpt-fast
    and nanochat hand theirs the cache): the cache and what each new token may attend,
    ``allowed [b, new, cache + new]`` (True = may attend). The model's attention calls
    :meth:`attend` layer by layer."""

    def __init__(self, cache: KVCache, allowed: torch.Tensor):
        self.cache, self.allowed = cache, allowed
        self._bias = None  # the mask as an additive bias, made once for all the layers
        new = allowed.shape[2] - cache.length
        if new != allowed.shape[1] or cache.length + new > cache.capacity:
            raise ValueError(f"a decoding step's mask covers {allowed.shape[2]} keys for "
                             f"{allowed.shape[1]} new tokens over a cache of {cache.length}: "
                             "call cache.reserve(new tokens) before building it")

    def attend(self, layer: int, q, k, v, scale=None):
        """Attention of the new queries ``q [b, n, s, d]`` over ``[cache ; new]`` (``k, v``
        un-expanded ``[b, g, s, d]``), staging the new keys and values for
        :meth:`KVCache.commit`."""
        import torch.nn.functional as F

        k, v = self.cache.write(layer, k, v)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if self._bias is None or self._bias.dtype != q.dtype:
            self._bias = torch.zeros(self.allowed.shape, dtype=q.dtype, device=q.device)
            self._bias.masked_fill_(~self.allowed, float("-inf"))
            self._bias = self._bias[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._bias, scale=scale)
