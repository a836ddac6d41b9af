"""The KV cache of committed (clean) tokens, and the hook through which attention uses it.

A clean token's keys and values never change once computed (SPEC section 3), so the cache is
exact. During a decoding step the model runs on a few *new* tokens (the tokens committed by the
previous step, and [MASK] queries); :func:`decode_step` makes the ``sdpa`` core attention attend
``[cache ; new]`` under the step's mask, and stages the new keys and values; afterwards
:meth:`KVCache.commit` appends those of the committed tokens only. Each tensor-parallel rank
caches its own heads. Keys are cached after rotary embedding, at each token's own position.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

_ACTIVE: Optional["DecodeStep"] = None


class KVCache:
    """Per layer ``k, v [b, groups, S, d]`` and ``valid [b, S]`` (ragged batches, cropped slots)."""

    def __init__(self, num_layers: int, batch: int, device):
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self._staged: dict[int, tuple] = {}

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def commit(self, commit: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the staged keys/values of the new tokens flagged in ``commit [b, n]``,
        compacted to the largest per-sample count."""
        count = int(commit.sum(1).max()) if commit.numel() else 0
        if count:
            order = torch.sort(commit.int(), dim=1, descending=True, stable=True).indices[:, :count]
            keep = torch.gather(commit, 1, order)
            for layer, (k, v) in self._staged.items():
                idx = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
                k_new, v_new = torch.gather(k, 2, idx), torch.gather(v, 2, idx)
                self.k[layer] = k_new if self.k[layer] is None else torch.cat([self.k[layer],
                                                                               k_new], 2)
                self.v[layer] = v_new if self.v[layer] is None else torch.cat([self.v[layer],
                                                                               v_new], 2)
            self.valid = torch.cat([self.valid, keep], 1)
            self.positions = torch.cat([self.positions, torch.gather(positions, 1, order)], 1)
        self._staged = {}

    def crop(self, keep_last: int) -> None:
        """Forget all but the ``keep_last`` most recent valid entries of each sample (past the
        model's context)."""
        newer = self.valid.flip(1).cumsum(1).flip(1)  # valid entries at or after each slot
        self.valid = self.valid & (newer <= keep_last)


class DecodeStep:
    def __init__(self, cache: KVCache, allowed: torch.Tensor):
        self.cache, self.allowed = cache, allowed  # allowed: [b, new, cache + new]


@contextlib.contextmanager
def decode_step(cache: KVCache, allowed: torch.Tensor):
    """Within this context the model's ``sdpa`` attention runs one KV-cached decoding step."""
    global _ACTIVE
    _ACTIVE = DecodeStep(cache, allowed)
    try:
        yield
    finally:
        _ACTIVE = None


def active() -> Optional[DecodeStep]:
    return _ACTIVE


def attend(layer: int, q, k, v, scale):
    """Attention of the new queries ``q [b, n, s, d]`` over ``[cache ; new]`` (``k, v`` un-expanded
    ``[b, g, s, d]``), staging the new keys and values for :meth:`KVCache.commit`."""
    import torch.nn.functional as F

    step = _ACTIVE
    cache = step.cache
    cache._staged[layer] = (k, v)
    if cache.k[layer] is not None:
        k = torch.cat([cache.k[layer], k], 2)
        v = torch.cat([cache.v[layer], v], 2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=step.allowed[:, None], scale=scale)
