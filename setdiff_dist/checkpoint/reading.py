"""Reading a checkpoint at resume so that, in all, each byte is read about once.

The data-parallel replicas of a model-parallel rank all need the same files: the module's state
and the client state (megatron's and FSDP's ``megatron_dp_model_*.pt``, DeepSpeed's
``mp_rank_*_model_states.pt`` and ``layer_*`` files). Read by every replica, that is DP times
the model's bytes from the file system at every restart (about 2 TB for 8B at TP8 on 1024 GPUs).
:func:`parallel_load` has each replica read an equal range of such a file's tensor bytes
(through a memory map that touches nothing else) and the replicas exchange the ranges in one
all-gather: one collective per file (and one of 32 bytes a rank that checks they read the same
file), whatever DP is, as megatron's fully parallel load does (``--ckpt-fully-parallel-load``).
A rank's own files (its optimizer shard,
its RNG) are read whole by that rank. :func:`shared_by_replicas` says which is which.

:data:`TALLY` counts the bytes each rank reads from checkpoint files, by kind (``verify``: the
checksums at resume; ``load``: what the engine loads), so that a resume can say what it read.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile

import torch
import torch.distributed as dist

from setdiff_dist.checkpoint.files import TALLY, CheckpointError, balance  # noqa: F401

# the files every data-parallel replica of a model-parallel rank loads (the rest are one rank's)
_SHARED = re.compile(r"^(mp_rank_\d+_model_states\.pt|layer_\d+(-model_\d+)?-model_states\.pt"
                     r"|megatron_dp_model_tp\d+_pp\d+\.pt)$")


def shared_by_replicas(path: str) -> bool:
    """Whether every data-parallel replica of a model-parallel rank loads the file ``path``
    (the module's state and the client state), rather than one rank (an optimizer shard, a
    ZeRO-3 partition, an RNG state)."""
    return bool(_SHARED.match(os.path.basename(path)))


def whole_load(path: str, kind: str = "load", **kwargs):
    """``torch.load`` of all of ``path`` on the CPU, counted."""
    TALLY.add(kind, os.path.getsize(path))
    return torch.load(path, map_location="cpu", **kwargs)


def _walk(obj, fn):
    """``obj`` with each tensor ``t`` in its dicts, lists and tuples replaced by ``fn(t)``
    (dicts and lists in place; a tuple only rebuilt when an element changed, so that a
    ``torch.Size`` stays one)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _walk(obj[k], fn)
    elif isinstance(obj, list):
        obj[:] = [_walk(v, fn) for v in obj]
    elif isinstance(obj, tuple):
        new = [_walk(v, fn) for v in obj]
        if any(a is not b for a, b in zip(new, obj)):
            return type(obj)(*new) if hasattr(obj, "_fields") else type(obj)(new)
    return obj


def gather_into(out: torch.Tensor, mine: torch.Tensor, group=None) -> None:
    """Every rank's ``mine`` into ``out``, in rank order: one collective (torch's
    ``all_gather_single``, ``all_gather_into_tensor`` before it)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


def collective_device(group=None) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def megabytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def parallel_load(path: str, group=None):
    """``torch.load(path)`` on the CPU, called by every rank of ``group`` for the same file,
    each reading about 1/N of its bytes: the file is memory-mapped (the pickle is read by
    all, the tensors' storages by none), each rank copies out 1/N of the storages' bytes (end
    to end), and one all-gather of bytes hands every rank all of them. The result equals
    ``torch.load``'s, storage sharing included. A file of torch's legacy format, or a group of
    one, is read whole. Two collectives, whatever the group's size: the first, of 32 bytes a
    rank, raises a :class:`CheckpointError` on every rank if they were not loading the same
    file."""
    world = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if world == 1 or not zipfile.is_zipfile(path):
        return whole_load(path)
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    state = torch.load(path, map_location="cpu", mmap=True)
    storages: dict[int, torch.UntypedStorage] = {}  # by address, in the order first met

    def note(t):
        s = t.untyped_storage()
        if s.nbytes():
            storages.setdefault(s.data_ptr(), s)
        return t

    _walk(state, note)
    keys = list(storages)
    sizes = [storages[k].nbytes() for k in keys]
    # first, in one small all-gather, that the ranks are loading the same file
    device = collective_device(group)
    head = torch.frombuffer(bytearray(hashlib.sha256(
        f"{os.path.realpath(path)}:{os.path.getsize(path)}".encode()).digest()), dtype=torch.uint8)
    heads = torch.empty(world * head.numel(), dtype=torch.uint8, device=device)
    gather_into(heads, head.to(device), group)
    if not bool((heads.view(world, -1).cpu() == head).all()):
        raise CheckpointError(f"{path}: the ranks that share it were loading different files "
                              "at once (a bug in setdiff-dist: please report it); set "
                              "checkpoint.parallel_load=false to resume meanwhile")
    # the storages end to end, cut in equal ranges (a module whose parameters are views of one
    # buffer, as megatron's are, is one storage): each rank copies its range out of the map
    total = sum(sizes)
    slot = max(-(-total // world), 1)
    lo, hi = rank * slot, min((rank + 1) * slot, total)
    mine = torch.zeros(slot, dtype=torch.uint8)
    at = 0
    for k, n in zip(keys, sizes):
        a, b = max(at, lo), min(at + n, hi)
        if a < b:
            whole = torch.empty(0, dtype=torch.uint8).set_(storages[k])
            mine[a - lo:b - lo].copy_(whole[a - at:b - at])
        at += n
    # what this rank read: its range, and the rest of the file that is not a storage (the
    # pickle, the archive's headers), which every rank reads
    TALLY.add("load", max(0, hi - lo) + max(0, os.path.getsize(path) - total))
    every = torch.empty(world * slot, dtype=torch.uint8, device=device)
    gather_into(every, mine.to(device), group)
    every = every.cpu()
    fresh, at = {}, 0
    for k, n in zip(keys, sizes):
        fresh[k] = every[at:at + n].clone().untyped_storage()
        at += n
    del every

    def rebuilt(t):
        s = t.untyped_storage()
        if not s.nbytes():
            return t
        new = torch.empty(0, dtype=t.dtype).set_(fresh[s.data_ptr()], t.storage_offset(),
                                                 t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(new, requires_grad=t.requires_grad)
        return new

    return _walk(state, rebuilt)


class ParallelRead:
    """A DeepSpeed checkpoint engine for loading (in place of the engine's own, around its
    ``load_checkpoint``): the files every data-parallel replica loads through
    :func:`parallel_load` over ``group`` (the data-parallel group; None: every file whole),
    the others whole; every read counted."""

    def __init__(self, real, group):
        self.real, self.group = real, group

    def load(self, path: str, map_location=None):
        if self.group is not None and shared_by_replicas(path):
            return parallel_load(path, self.group)
        return whole_load(path)

    def __getattr__(self, name):
        return getattr(self.real, name)
