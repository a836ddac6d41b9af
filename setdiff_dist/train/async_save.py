"""Checkpoints written in the background (``checkpoint.async_save``).

A save has two parts. The collective part runs on the training thread, at the step boundary,
as a blocking save does: the disk-space check, DeepSpeed's ``save_checkpoint`` (its tag check
and barriers) with a :class:`Capture` in place of its checkpoint engine, which copies each state
dict it is given to host memory instead of writing it, the ZeRO-3 / EMA gathers of the layout-
free weights (each rank keeps a host copy of its share) and the RNG state. Then training goes
on, and a background thread (:class:`AsyncSaver`) writes every file, waits on a gloo group of
its own for every rank's files to be on disk, hashes its share, and rank 0 writes the manifest,
moves ``latest`` and prunes, as a blocking save does. So:

- at most one save is in flight: the next save (and the end of training, a stop on a signal)
  first waits for the one before;
- ``latest`` moves only after every file of every rank is written and hashed; a process killed
  while the thread writes leaves ``latest`` at the previous checkpoint and a step directory
  without a manifest, which the next start removes;
- the thread's collectives go over their own process group (gloo, created at the first save), so
  they never interleave with the training thread's.

The host copy costs the checkpoint's size in host memory while the write runs.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from setdiff_dist.progress import progress


def host_copy(obj):
    """``obj`` with every tensor copied to host memory, its containers copied, the rest deep
    copied: nothing the training thread changes next reaches the copy."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # (an OrderedDict stays one)
        for k, v in obj.items():
            out[k] = host_copy(v)
        return out
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class Capture(CheckpointEngine):
    """DeepSpeed's checkpoint engine, as a save sees it, that keeps host copies of what it is
    asked to save (``saved``: ``[(state dict, path)]``) for ``real`` to write later."""

    def __init__(self, real: CheckpointEngine):
        super().__init__(None)
        self.real = real
        self.saved: list[tuple] = []

    def create(self, info):
        pass

    def makedirs(self, path, exist_ok=False):
        self.real.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        self.saved.append((host_copy(state_dict), path))

    def load(self, path: str, map_location=None):
        return self.real.load(path, map_location)

    def commit(self, info):
        return True

    def is_data_parallel_writer(self, dp_rank):
        return self.real.is_data_parallel_writer(dp_rank)

    def is_decoupled(self):
        return False

    def preserves_storage_sharing(self):
        return False  # (host_copy already gives every tensor its own storage)

    def write(self, done: Callable[[], None]) -> None:
        """Write what was captured, calling ``done()`` after each file."""
        for state, path in self.saved:
            self.real.save(state, path)
            done()
        self.saved = []


def _background_priority() -> None:
    """This thread at the lowest CPU priority (Linux: a thread's own nice value): the write
    takes the cores training leaves idle, not the ones it computes on."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class AsyncSaver:
    """The background writer of one trainer: one save in flight at most."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._on_error: Optional[Callable[[BaseException], BaseException]] = None
        self._group = None
        self.files_written = 0  # (the thread's progress, for the hang watch)
        self.path: Optional[str] = None  # the save in flight (or the last one)

    def group(self):
        """The checkpoint thread's process group (a collective the first time: every rank's
        training thread calls it, at the same save)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None
        return self._group

    def submit(self, path: str, write: Callable[[], None], finish: Callable[[object], None],
               on_error: Callable[[BaseException], BaseException]) -> None:
        """Run ``write()`` then ``finish(group)`` in the background; an exception is kept and
        raised, through ``on_error``, by the next :meth:`wait`."""
        self.wait()
        group = self.group()
        self.path, self._on_error = path, on_error

        def run():
            _background_priority()
            try:
                write()
                finish(group)
            except BaseException as exc:  # noqa: BLE001 (raised on the training thread)
                self._error = exc

        self._thread = threading.Thread(target=run, name="setdiff-checkpoint", daemon=True)
        self._thread.start()

    def done(self) -> None:
        """One more file written (called by the thread)."""
        self.files_written += 1

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight; its failure is raised here. While the thread writes
        files the hang watch hears of it; a thread stuck for good is left to the watch."""
        if self._thread is None:
            return
        seen = self.files_written
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)
            if self.files_written != seen:
                seen = self.files_written
                progress("checkpoint")
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise self._on_error(error)
