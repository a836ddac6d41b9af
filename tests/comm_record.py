"""A recording wrapper of ``torch.distributed``'s collectives, for the tests that check what a
training step sends: which collective, on which group, how many bytes, and when.

Install it in a rank before DeepSpeed or megatron-core run their first collective (DeepSpeed's
backend keeps references to some functions when it starts). Every call is passed on unchanged;
the record is ``Call(t, kind, ranks, nbytes, wire, tag)`` with ``wire`` the bytes this rank
puts on its links under :func:`setdiff_dist.train.scale.wire_bytes`'s ring convention, the one
the scale model predicts with.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from setdiff_dist.train.scale import wire_bytes


@dataclass
class Call:
    t: float
    kind: str
    ranks: tuple  # the global ranks of the group
    nbytes: int  # the payload: the whole tensor (all-gather: the gathered output)
    wire: float  # bytes this rank sends
    tag: object = None  # what ``CommRecorder.tag()`` said at the call


def _bytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


# (name, kind, payload of the args): the payload as the whole tensor of the collective
_WRAPPED = {
    "all_reduce": ("all_reduce", lambda a, k: a[0] if a else k["tensor"]),
    "reduce": ("reduce", lambda a, k: a[0] if a else k["tensor"]),
    "broadcast": ("broadcast", lambda a, k: a[0] if a else k["tensor"]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: a[1] if len(a) > 1 else k["input"]),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: a[1] if len(a) > 1 else k["input"]),
    "reduce_scatter": ("reduce_scatter", lambda a, k: a[1] if len(a) > 1 else k["input_list"]),
    "all_gather_into_tensor": ("all_gather",
                               lambda a, k: a[0] if a else k["output_tensor"]),
    "_all_gather_base": ("all_gather", lambda a, k: a[0] if a else k["output_tensor"]),
    "all_gather": ("all_gather", lambda a, k: a[0] if a else k["tensor_list"]),
    # (torch 2.13's names, which FSDP2 calls)
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: a[1] if len(a) > 1 else k["input"]),
    "all_gather_single": ("all_gather", lambda a, k: a[0] if a else k["output_tensor"]),
    "all_to_all_single": ("all_to_all", lambda a, k: a[1] if len(a) > 1 else k["input"]),
    "send": ("send", lambda a, k: a[0] if a else k["tensor"]),
    "isend": ("send", lambda a, k: a[0] if a else k["tensor"]),
}


class CommRecorder:
    """``with CommRecorder() as rec: ...`` wraps the collectives of :data:`_WRAPPED` until the
    block ends; ``rec.calls`` is the record, ``rec.active`` turns recording off without
    unwrapping."""

    def __init__(self):
        self.calls: list[Call] = []
        self.active = True
        self._saved = {}
        self._inside = False
        self.tag = None  # a callable: its answer is stored with each call

    def _record(self, kind, payload, group, root: Optional[int] = None):
        if not self.active or not dist.is_initialized():
            return
        ranks = _ranks(group)
        n = _bytes(payload)
        self.calls.append(Call(time.perf_counter(), kind, ranks, n,
                               wire_bytes(kind, n, len(ranks)),
                               self.tag() if self.tag is not None else None))

    def _wrap(self, name, kind, payload):
        fn = getattr(dist, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                # the group is the positional argument after the tensors / root
                for a in args:
                    if isinstance(a, dist.ProcessGroup):
                        group = a
            if self._inside:  # torch's own wrappers call each other: record the outer one
                return fn(*args, **kwargs)
            self._record(kind, payload(args, kwargs), group)
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False

        return fn, wrapper

    def __enter__(self):
        # also in distributed_c10d's namespace (P2POp accepts only the isend it sees there, and
        # batch_isend_irecv calls each op's function: batched sends are recorded once) and in
        # the libraries' modules that took a reference at import (megatron's
        # ``dist_all_gather_func``)
        self._wrappers = {}
        for name, (kind, payload) in _WRAPPED.items():
            if hasattr(dist, name):
                self._saved[name], self._wrappers[name] = self._wrap(name, kind, payload)
        self._swap(self._saved, self._wrappers)
        return self

    def __exit__(self, *exc):
        self._swap(self._wrappers, self._saved)
        self._saved.clear()

    @staticmethod
    def _swap(old: dict, new: dict) -> None:
        """Every module attribute that is ``old[name]`` becomes ``new[name]``."""
        by_id = {id(fn): new[name] for name, fn in old.items()}
        modules = [dist, c10d] + [m for n, m in list(sys.modules.items())
                                  if n.startswith(("megatron.", "deepspeed."))]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if id(value) in by_id and callable(value):
                    setattr(module, attr, by_id[id(value)])

    def between(self, start: float, end: float) -> list[Call]:
        return [c for c in self.calls if start <= c.t < end]


class RecordingDevice:
    """A stand-in for CUDA events behind :class:`setdiff_dist.train.timers.DeviceClock`: an
    event is recorded at the host's time, and each wait for one (the device synchronize the
    timers may do) is recorded with whether a step was running then (``inside``: a callable
    the test gives, e.g. from the trainer's timers)."""

    def __init__(self, inside):
        self.inside, self.waits = inside, []

    def clock(self):
        import time

        from setdiff_dist.train.timers import DeviceClock

        class Event:
            def record(ev):
                ev.t = time.perf_counter()

            def elapsed_time(ev, other):  # (milliseconds, as CUDA's)
                return (other.t - ev.t) * 1000.0

        return DeviceClock(event=Event, synchronize=lambda ev: self.waits.append(self.inside()))
