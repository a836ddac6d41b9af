"""The updated parameters' gather over the data-parallel ranks, overlapped with the next forward.

DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``, our default in bf16 and fp32) keeps
each parameter group as one flat 16/32-bit buffer split into one contiguous partition per
data-parallel rank. After its step each rank has updated only its own partition, and DeepSpeed
all-gathers the others at the end of ``step()``, synchronously: the gather is exposed, as long as
a ``2 x parameters x (DP-1)/DP``-byte transfer takes.

:class:`ParamPrefetch` defers it: inside :meth:`ParamPrefetch.deferring` (around the engine's
``step()``) DeepSpeed's call to ``all_gather_dp_groups`` for this optimizer launches instead one
asynchronous broadcast per bucket, from the rank that owns it, in the order the forward needs
the parameters; a forward pre-hook on each module that holds parameters waits for the buckets
those parameters lie in, so the first layers compute while the later buckets are still on the
wire (megatron-core's ``overlap_param_gather`` does the same over its own bucketed layout).

Why broadcasts and not an all-gather per bucket: DeepSpeed lays the flat buffer out rank by
rank, so a bucket of the forward's order lies in one rank's partition, and the ``k``-th slice of
every rank's partition (what one all-gather would move) spans the whole model: its last bucket
would be needed a ``1/DP`` of the way into the forward. A broadcast of a bucket from its owner
moves the same bytes per rank as its share of the all-gather (``(DP-1)/DP`` of it on a ring,
NCCL's bus-bandwidth convention) and lets each bucket arrive when its layers need it. The
values gathered are DeepSpeed's, bit for bit: only when they arrive changes.

Anything that reads the parameters outside a forward (a checkpoint save, the weights' EMA, the
end of training) calls :meth:`ParamPrefetch.finish` first; the next step's ``deferring`` waits
for any bucket no forward asked for before the optimizer writes the partitions again.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
from typing import Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Bucket:
    group: int           # the optimizer's parameter group
    start: int           # elements into the group's flat buffer
    view: torch.Tensor   # the flat buffer's slice [start, start + numel)
    src: int             # the global rank that owns (has updated) it
    process_group: object
    key: float           # the forward position of its first parameter: the launch order


class ParamPrefetch:
    """Deferred, bucketed parameter gather of ``engine``'s ZeRO-1/2 optimizer (see the module's
    docstring); ``timed(fn)`` wraps each wait (the trainer's ``param_gather`` phase)."""

    def __init__(self, engine, bucket_elements: int,
                 timed: Optional[Callable[[Callable], Callable]] = None):
        self._opt = opt = engine.optimizer
        order = {}  # id(param) -> position of its module in the model (the forward's order)
        for position, module in enumerate(engine.module.modules()):
            for p in module.parameters(recurse=False):
                order.setdefault(id(p), position)
        self.buckets: list[Bucket] = []
        starts = {}  # group -> sorted bucket starts, for the parameters' lookup
        for i, flat in enumerate(opt.bit16_groups_flat):
            pg = opt.real_dp_process_group[i]
            if dist.get_world_size(pg) == 1:
                continue
            base = flat.storage_offset()
            ranges = [(p, off, p.numel()) for p, off in zip(opt.round_robin_bit16_groups[i],
                                                           opt.round_robin_bit16_offsets[i])]
            for r, part in enumerate(opt.parallel_partitioned_bit16_groups[i]):
                first, n = part.storage_offset() - base, part.numel()
                for a in range(first, first + n, bucket_elements):
                    b = min(first + n, a + bucket_elements)
                    key = min((order.get(id(p), math.inf) for p, off, k in ranges
                               if off < b and off + k > a), default=math.inf)
                    self.buckets.append(Bucket(i, a, flat.narrow(0, a, b - a),
                                               dist.get_global_rank(pg, r), pg, key))
        self.buckets.sort(key=lambda bk: bk.key)
        for index, bk in enumerate(self.buckets):
            starts.setdefault(bk.group, []).append((bk.start, index))
        for s in starts.values():
            s.sort()

        def covering(group, off, n):
            s = starts.get(group)
            if not s:
                return []
            lo = max(bisect.bisect_right(s, (off, math.inf)) - 1, 0)
            hi = bisect.bisect_left(s, (off + n, -1))
            return [index for _, index in s[lo:hi]]

        group_of = {id(p): (i, off) for i, g in enumerate(opt.round_robin_bit16_groups)
                    for p, off in zip(g, opt.round_robin_bit16_offsets[i])}
        self._pending: dict[int, object] = {}
        self._hooks = []
        wait = timed(self._wait) if timed else self._wait
        for module in engine.module.modules():
            needed = sorted({index for p in module.parameters(recurse=False)
                             if id(p) in group_of
                             for index in covering(*group_of[id(p)], p.numel())})
            if needed:
                self._hooks.append(module.register_forward_pre_hook(
                    self._hook(needed, wait)))

    @classmethod
    def maybe(cls, engine, cfg, timed=None) -> Optional["ParamPrefetch"]:
        """The prefetch of a run whose optimizer shards its parameters over more than one
        data-parallel rank with ``zero.overlap_param_gather`` on, else ``None``."""
        opt = engine.optimizer
        if not cfg.zero.overlap_param_gather or not all(
                hasattr(opt, a) for a in ("bit16_groups_flat", "parallel_partitioned_bit16_groups",
                                          "round_robin_bit16_offsets", "real_dp_process_group")):
            return None
        if all(dist.get_world_size(pg) == 1 for pg in opt.real_dp_process_group):
            return None
        return cls(engine, cfg.zero.reduce_bucket_size, timed)

    def _hook(self, needed: list, wait):
        def hook(module, args):
            if self._pending:
                wait(needed)
        return hook

    def _wait(self, indices) -> None:
        for index in indices:
            work = self._pending.pop(index, None)
            if work is not None:
                work.wait()

    @property
    def pending(self) -> int:
        """Buckets launched and not yet waited for."""
        return len(self._pending)

    def launch(self) -> None:
        """Broadcast every bucket from its owner, asynchronously, in the forward's order."""
        self.finish()
        for index, bk in enumerate(self.buckets):
            self._pending[index] = dist.broadcast(bk.view, src=bk.src, group=bk.process_group,
                                                  async_op=True)

    def finish(self) -> None:
        """Wait for every bucket still on the wire: the parameters are whole again."""
        self._wait(list(self._pending))

    @contextlib.contextmanager
    def deferring(self):
        """Around the engine's ``step()``: the ZeRO optimizer's gather of its updated partitions
        becomes :meth:`launch` (a gather of another optimizer, or a call outside, runs as it
        did)."""
        from deepspeed.runtime.zero import stage_1_and_2

        self.finish()  # the optimizer is about to write the partitions
        original = stage_1_and_2.all_gather_dp_groups
        mine = self._opt.bit16_groups_flat

        def deferred(*args, **kwargs):
            groups = kwargs.get("groups_flat", args[0] if args else None)
            if groups is not mine:
                return original(*args, **kwargs)
            self.launch()

        with mock.patch.object(stage_1_and_2, "all_gather_dp_groups", deferred):
            yield

    def remove(self) -> None:
        """Wait for what is on the wire and take the hooks off."""
        self.finish()
        for h in self._hooks:
            h.remove()
        self._hooks = []
