"""How megatron splits a tensor over tensor-parallel ranks, and back: pure tensor functions that
the model (sharding its weights), the checkpoint readers (merging per-rank files) and the
decode-time model share."""

from __future__ import annotations

import torch


def split_shard(full: torch.Tensor, rank: int, size: int, dim: int, stride: int = 1):
    """Rank ``rank`` of ``size``'s slice of ``full`` along ``dim``, the way megatron splits it:
    with ``stride`` (e.g. 2 for SwiGLU's ``[gate ; up]``) each rank gets its own part of each of
    the ``stride`` blocks."""
    chunks = torch.split(full, full.shape[dim] // (size * stride), dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


def merge_shards(parts: list, dim: int, stride: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_shard`: the full tensor from every rank's slice, in order."""
    size = len(parts)
    split = [torch.split(p, p.shape[dim] // stride, dim=dim) for p in parts]
    return torch.cat([split[c % size][c // size] for c in range(size * stride)], dim=dim)
