"""What a training step sends: the bytes on the wire of each collective.

Bytes on the wire follow the ring algorithms' convention (what NCCL's bus bandwidth measures):
for a collective over ``w`` ranks on a tensor of ``n`` bytes (all-gather: the gathered output;
reduce-scatter: the whole input), each rank sends ``2 (w-1)/w n`` for an all-reduce and
``(w-1)/w n`` for a reduce-scatter, all-gather, reduce or broadcast (a reduce or broadcast's
root sends nothing and the others about ``n``: ``(w-1)/w n`` is the mean over the ranks that
take turns as root); a point-to-point send is ``n``.
"""

from __future__ import annotations

_RING = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "reduce": 1.0,
         "broadcast": 1.0, "all_to_all": 1.0}


def wire_bytes(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends for a collective ``kind`` of ``nbytes`` over ``world`` ranks."""
    if kind == "send":
        return float(nbytes)
    if world <= 1:
        return 0.0
    return _RING[kind] * (world - 1) / world * nbytes
