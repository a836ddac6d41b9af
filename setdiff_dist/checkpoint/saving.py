"""A save that cannot be written: refused before anything is written when the disk cannot hold
it (every rank agrees), and otherwise cleaned up and explained (the disk full, a file-size limit)
with what ``latest`` still points at. Nothing is left half-written and the last good checkpoint
is never touched."""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from .files import CheckpointError, complete_checkpoints, pointed
from .format import LATEST, is_complete
from .manifest import read_manifest

# how torch's checkpoint writer reports a write the OS refused (its errno is lost on the way),
# or a directory gone under it (another rank's failed save removed the partial directory)
WRITE_FAILURES = ("PytorchStreamWriter", "unexpected pos", "file write failed",
                  "inline_container", "iostream error", "basic_ios", "Parent directory")


def write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write (an OSError, or torch's writer failing under one),
    not a collective that lost a peer."""
    return isinstance(exc, OSError) or any(s in str(exc) for s in WRITE_FAILURES)


def _previous_size(root: str, tag: str) -> Optional[int]:
    """Bytes of the newest complete checkpoint before ``tag`` (what this save will take,
    give or take a few bytes of metadata), or None without one."""
    older = [p for p in complete_checkpoints(os.path.dirname(root)) if os.path.basename(p) < tag]
    if not older:
        return None
    try:
        return sum(f["bytes"] for f in read_manifest(older[-1]).get("files", {}).values()) or None
    except (CheckpointError, KeyError, TypeError):
        return None


def _free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_space(root: str, tag: str) -> Optional[int]:
    """Refuse a save that cannot fit, before anything is written: the previous checkpoint's
    size against the least free space any rank sees (all ranks agree). Returns the size (None
    before the first save: the save itself then says it if the disk fills)."""
    box = [_previous_size(root, tag) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    need = box[0]
    free = torch.tensor([float(_free_bytes(root))], dtype=torch.float64)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    free = free.item()
    if need is not None and free < need:
        raise CheckpointError(
            f"not enough disk space to save {tag}: it needs about {need / 2**20:,.1f} MiB (the "
            f"size of the previous checkpoint) and {root} has {free / 2**20:,.1f} MiB free"
            f"{' on one of the ranks' if dist.get_world_size() > 1 else ''}. Nothing was "
            f"written; {_resumable(root)}. Free space (or lower checkpoint.keep_last) and run "
            "the same command again")
    return need


def _resumable(root: str) -> str:
    latest = pointed(root)
    return (f"{LATEST} still points at {os.path.basename(latest)}, and resume=auto goes on "
            "from it (the steps since are lost)" if latest else
            "there is no earlier checkpoint: the run starts over")


def save_failed(exc: BaseException, root: str, tag: str, need: Optional[int]) -> CheckpointError:
    """The error for a save that failed to write (removing its partial directory, so that the
    space comes back and nothing half-written remains): the disk full, a file-size limit, or
    the OS error as it came."""
    import errno
    import resource

    code = getattr(exc, "errno", None)
    free = _free_bytes(root)  # (before the partial save is removed)
    path = os.path.join(root, tag)
    if not is_complete(path):
        shutil.rmtree(path, ignore_errors=True)
    for f in os.listdir(root) if os.path.isdir(root) else []:
        if f.startswith(f"{LATEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(root, f))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    size = f"about {need / 2**20:,.1f} MiB" if need else \
        "about the size of the weights and the optimizer state"
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < 16 * 2**20):
        cause = (f"the disk is full ({free / 2**20:,.1f} MiB free in {root}; the save needs "
                 f"{size})")
    elif code == errno.EFBIG or (code is None and limit != resource.RLIM_INFINITY):
        cause = (f"a file of the save is larger than this process may write (ulimit -f: "
                 f"{limit / 1024:,.0f} KiB; the save needs {size} in all)")
    else:
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    return CheckpointError(f"cannot save checkpoint {tag}: {cause}. The partial save is "
                           f"removed (what another rank still wrote, by the next start); "
                           f"{_resumable(root)}. Fix it and run the same command again",
                           every_rank=False)
