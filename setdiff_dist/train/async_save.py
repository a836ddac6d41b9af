"""Checkpoints written in the background (``checkpoint.async_save``), and how the ranks of any
save agree that it is complete (:class:`SaveAgreement`).

A save has two parts. The collective part runs on the training thread, at the step boundary,
as a blocking save does: the disk-space check, DeepSpeed's ``save_checkpoint`` (its tag check
and barriers) with a :class:`Capture` in place of its checkpoint engine, which copies each state
dict it is given to host memory instead of writing it, the ZeRO-3 / EMA gathers of the layout-
free weights (each rank keeps a host copy of its share) and the RNG state. Then training goes
on, and a background thread (:class:`AsyncSaver`) has every file written (by this rank's
writer process, from the host buffers the state was staged in: :mod:`~setdiff_dist.train.
writer`), waits for every rank's files to be on disk, hashes its share, and rank 0 writes
the manifest, moves ``latest`` and prunes, as a blocking save does. So:

- at most one save is in flight: the next save (and the end of training, a stop on a signal)
  first waits for the one before;
- ``latest`` moves only after every file of every rank is written and hashed; a process killed
  while the thread writes leaves ``latest`` at the previous checkpoint and a step directory
  without a manifest, which the next start removes;
- the thread uses no process group: it agrees with the other ranks through the c10d store that
  the default group already has (:class:`SaveAgreement`), so it never interleaves with the
  training thread's collectives, and a save adds no process group (at N ranks a world-wide gloo
  group would be N - 1 more connections per rank, set up in the middle of training).

The host copy costs the checkpoint's size in host memory while the write runs.

The agreement (the blocking save's too) is two rounds through the store, each a gather to
rank 0 and rank 0's word back: every rank says its files are written (the hashing then reads
other ranks' files); every rank gives its share's file table, and rank 0 writes the manifest,
moves ``latest``, prunes and says so (no rank returns before ``latest`` has moved). Rank 0 waits
for the others up to the process group's timeout, then names the ranks that never reported and
tells the others, leaving ``latest`` where it was; a rank that never hears from rank 0 gives up
a little later, naming rank 0. Every key is deleted once read: rank 0 deletes what the others
wrote, and the last rank to read rank 0's word deletes it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import json
import os
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from setdiff_dist.errors import EXIT_FAILED, TrainingError
from setdiff_dist.progress import progress

# How long rank 0 waits for the other ranks in a save's agreement when the process group's own
# timeout (train.collective_timeout_s, which a collective waits) cannot be read: torch's default
# for a gloo group, 30 minutes. The background write of a large checkpoint on a slow file system
# may keep a rank minutes behind the others; a shorter wait would fail a save that is merely slow.
AGREE_TIMEOUT_S = 1800.0
# The ranks other than 0 wait this much longer (at most; never more than the timeout again) for
# rank 0's word than rank 0 waits for theirs: rank 0's message naming the ranks that never
# reported reaches them before they give up on their own.
GRACE_S = 60.0
# Every key of a save's agreement is under this prefix (of the default group's store, which
# prefixes it again: default_pg/)
KEY_PREFIX = "setdiff/save"

_saves = itertools.count()


def host_copy(obj, copy_tensor: Optional[Callable] = None):
    """``obj`` with every tensor copied to host memory (by ``copy_tensor``: a save's
    :meth:`~setdiff_dist.train.writer.Staging.copy`), its containers copied, the rest deep
    copied: nothing the training thread changes next reaches the copy."""
    if torch.is_tensor(obj):
        if copy_tensor is not None:
            return copy_tensor(obj)
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # (an OrderedDict stays one)
        for k, v in obj.items():
            out[k] = host_copy(v, copy_tensor)
        return out
    if isinstance(obj, list):
        return [host_copy(v, copy_tensor) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(host_copy(v, copy_tensor) for v in obj)
    return copy.deepcopy(obj)


class Capture(CheckpointEngine):
    """DeepSpeed's checkpoint engine, as a save sees it, that keeps host copies of what it is
    asked to save (``saved``: ``[(state dict, path)]``) for ``real`` to write later."""

    def __init__(self, real: CheckpointEngine, copy_tensor: Optional[Callable] = None):
        super().__init__(None)
        self.real, self.copy_tensor = real, copy_tensor
        self.saved: list[tuple] = []

    def create(self, info):
        pass

    def makedirs(self, path, exist_ok=False):
        self.real.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        self.saved.append((host_copy(state_dict, self.copy_tensor), path))

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

    def calls(self) -> list:
        """The writes of what was captured, as the writer process takes them: torch's save,
        as the real engine (DeepSpeed's ``TorchCheckpointEngine``, or ours) does it."""
        zipped = getattr(self.real, "zipfile_serialization", True)
        calls = [(torch.save, (state, path), {"_use_new_zipfile_serialization": zipped})
                 for state, path in self.saved]
        self.saved = []
        return calls


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
        from .writer import Staging, WriterProcess

        self.staging = Staging()  # (the host copies, kept from save to save)
        self.writer = WriterProcess(self.staging)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._on_error: Optional[Callable[[BaseException], BaseException]] = None
        self.files_written = 0  # (the thread's progress, for the hang watch)
        self.path: Optional[str] = None  # the save in flight (or the last one)

    def submit(self, path: str, write: Callable[[], None], finish: Callable[[], None],
               on_error: Callable[[BaseException], BaseException],
               abandon: Optional[Callable[[BaseException], None]] = None) -> None:
        """Run ``write()`` then ``finish()`` in the background; an exception is kept and
        raised, through ``on_error``, by the next :meth:`wait`. (``finish`` agrees with the
        other ranks through the store, :class:`SaveAgreement`: no process group.) A failed
        ``write`` calls ``abandon(exc)``, which tells the other ranks (their ``finish`` then
        fails too, instead of waiting for this rank's files); :meth:`failed` says so to the
        training thread, which tells every rank at the next step boundary."""
        self.wait()
        self.path, self._on_error = path, on_error

        def run():
            _background_priority()
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 (raised on the training thread)
                self._error = exc
                if abandon is not None:
                    with contextlib.suppress(BaseException):  # (this rank's error is kept)
                        abandon(exc)
                return
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 (raised on the training thread)
                self._error = exc

        self._thread = threading.Thread(target=run, name="setdiff-checkpoint", daemon=True)
        self._thread.start()

    def save(self, job) -> None:
        """Save ``job`` (a prepared :class:`~setdiff_dist.train.checkpoint.Save`) in the
        background: its state captured now, on the training thread, into this saver's host
        buffers (:meth:`~setdiff_dist.train.checkpoint.Save.files`), then its writes (by the
        writer process) and its :meth:`~setdiff_dist.train.checkpoint.Save.finish` in the
        thread (:meth:`submit`)."""
        self.writer.start()
        self.staging.begin()
        writes = job.files(self.staging.copy)
        self.submit(job.path, lambda: job.write(writes, self.run), job.finish, job.failed,
                    job.abandon)

    def done(self) -> None:
        """One more file written (called by the thread)."""
        self.files_written += 1

    def run(self, calls: list) -> None:
        """(From the thread.) ``calls`` (``(function, args, kwargs)``) in the writer process,
        :meth:`done` after each; its error raised here."""
        self.writer.run(calls, self.done)

    def close(self) -> None:
        """End the writer process and free the host buffers: after the last save (a save in
        flight is abandoned: its directory, without a manifest, goes at the next start)."""
        in_flight = self.in_flight
        self.writer.close(wait=not in_flight)
        if not in_flight:
            self.staging.close()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def failed(self) -> bool:
        """Whether the save in flight has failed (not yet raised by :meth:`wait`): as soon as
        this rank's write has failed, while the thread may still be telling the other ranks
        (which waits for rank 0 to finish its own write). Local and cheap: the trainer asks at
        every step boundary."""
        return self._thread is not None and self._error is not None

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


class SaveNotAgreed(TrainingError):
    """A save the ranks could not agree was complete (a rank died or hung in it, or rank 0
    failed to finish it): ``latest`` still points at the previous checkpoint. A failure a
    restart may get past (exit code 1)."""

    exit_code = EXIT_FAILED


def save_name(tag: str) -> str:
    """The name of this process's next save (of checkpoint ``tag``) in the store: the tag and
    the number of saves this process has begun. Every rank calls it once at the start of every
    save, on the training thread: saves are collective, so every rank counts them alike and
    names a save alike, and a save of the same tag again (after a failed one) has keys of its
    own, never those an earlier attempt left."""
    return f"{KEY_PREFIX}/{tag}/{next(_saves)}"


def process_group_timeout() -> float:
    """Seconds a collective of the default process group waits (``train.collective_timeout_s``),
    else :data:`AGREE_TIMEOUT_S`."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        return min(pg._get_backend(device).options._timeout.total_seconds()
                   for device in pg._device_types)
    except Exception:  # noqa: BLE001 (torch's private API, which may move)
        return AGREE_TIMEOUT_S


def store_client():
    """A client of the default process group's store of its own: a wait on the store holds its
    client's lock for as long as it waits (every TCPStore operation takes the client's
    ``activeOpLock_``), which would stop the training thread's, and NCCL's, use of the store
    meanwhile. One more connection to the store's server, for one save; no rendezvous."""
    store = dist.distributed_c10d._get_default_store()
    try:
        return store.clone()
    except RuntimeError:  # (a store that cannot be cloned: waits then share its client)
        return store


def _ranks(ranks: list) -> str:
    shown = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more"
                                                if len(ranks) > 16 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


class SaveAgreement:
    """How the ``world`` ranks of one save (``name``: :func:`save_name`) agree, through the c10d
    ``store`` (by default a client of the default group's store of its own,
    :func:`store_client`), with no process group: :meth:`decide` rounds. ``what`` names the
    save in messages; ``timeout_s`` (by default the process group's): how long rank 0 waits
    for the other ranks.

    A round's keys, ``<name>/<stage>/...``, the same few at any number of ranks: ``values``
    (each rank but 0 appends its rank and value), ``count`` (how many have), ``all`` (set by
    the last of them), ``word`` (rank 0's: done, or why not) and ``seen`` (how many ranks have
    read the word). Rank 0 deletes the first three once it has read them; the last rank to read
    the word deletes the last two."""

    def __init__(self, store, name: str, rank: int, world: int, what: str,
                 timeout_s: Optional[float] = None):
        self.name, self.rank, self.world, self.what = name, rank, world, what
        self.timeout_s = process_group_timeout() if timeout_s is None else timeout_s
        self.store = store if store is not None or world == 1 else store_client()

    def decide(self, stage: str, value, act: Optional[Callable[[list], None]] = None) -> None:
        """Every rank gives ``value`` (JSON); rank 0 calls ``act(values)`` with every rank's,
        in rank order, and says how it went. Returns on every rank once ``act`` has returned;
        raises :class:`SaveNotAgreed` on every rank still there when a rank never reported,
        when rank 0 never answered, or when ``act`` failed (rank 0 raises ``act``'s error)."""
        if self.world == 1:
            if act is not None:
                act([value])
            return
        base = f"{self.name}/{stage}"
        if self.rank != 0:
            try:
                # (the append is applied before the count's answer comes back: one connection,
                # served in order; so when the count is complete, so are the values)
                self.store.append(f"{base}/values",
                                  json.dumps([self.rank, value]).encode() + b"\n")
                if self.store.add(f"{base}/count", 1) == self.world - 1:
                    self.store.set(f"{base}/all", b"")
                self._hear(base, stage)
            except dist.DistError as exc:  # (the store's server, rank 0's, is gone)
                raise SaveNotAgreed(
                    f"{self.what} is not complete: the job's store (served by rank 0) went "
                    f"away during the save ({stage}: {str(exc).splitlines()[0][:120]}): rank 0 "
                    "ended or cannot be reached. latest still points at the previous "
                    "checkpoint", every_rank=False) from None
            return
        try:
            values = self._gather(base, stage)
            if act is not None:
                act([value] + values)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # (the store may be what failed)
                self._say(base, str(exc) if isinstance(exc, SaveNotAgreed)
                          else f"{type(exc).__name__}: {exc}",
                          getattr(exc, "exit_code", EXIT_FAILED))
                self._forget(base)
            raise
        self._say(base, None)
        self._forget(base)

    def _gather(self, base: str, stage: str) -> list:
        """Every other rank's value, in rank order (rank 0), within the timeout."""
        try:
            self.store.wait([f"{base}/all"], datetime.timedelta(seconds=self.timeout_s))
        except dist.DistStoreError:  # (a timeout; a lost store fails what follows too)
            if not self.store.check([f"{base}/all"]):
                got = self._values(base) if self.store.check([f"{base}/values"]) else {}
                missing = [r for r in range(1, self.world) if r not in got]
                raise SaveNotAgreed(
                    f"{self.what} is not complete: {_ranks(missing)} of {self.world} never "
                    f"reported ({stage}) within {self.timeout_s:g} s (the process group's "
                    "timeout, train.collective_timeout_s): they died or hang. latest still "
                    "points at the previous checkpoint; the next start removes this "
                    "one") from None
        got = self._values(base)
        return [got[r] for r in range(1, self.world)]

    def _values(self, base: str) -> dict:
        lines = self.store.get(f"{base}/values").decode().splitlines()
        return {rank: value for rank, value in map(json.loads, lines)}

    def _say(self, base: str, error: Optional[str], exit_code: Optional[int] = None) -> None:
        self.store.set(f"{base}/word",
                       json.dumps({"error": error, "exit_code": exit_code}).encode())

    def _forget(self, base: str) -> None:
        for key in ("values", "count", "all"):
            self.store.delete_key(f"{base}/{key}")

    def _hear(self, base: str, stage: str) -> None:
        """Rank 0's word on ``stage`` (a rank other than 0)."""
        wait = self.timeout_s + min(GRACE_S, self.timeout_s)
        word = f"{base}/word"
        try:
            self.store.wait([word], datetime.timedelta(seconds=wait))
        except dist.DistStoreError:
            if not self.store.check([word]):
                raise SaveNotAgreed(
                    f"{self.what} is not complete: rank 0 never answered ({stage}) within "
                    f"{wait:g} s: it died or hangs. latest still points at the previous "
                    "checkpoint; the next start removes this one", every_rank=False) from None
        heard = json.loads(self.store.get(word))
        if self.store.add(f"{base}/seen", 1) == self.world - 1:  # the last to read the word
            self.store.delete_key(word)
            self.store.delete_key(f"{base}/seen")
        if heard["error"] is not None:  # (rank 0 prints it: every_rank)
            exc = SaveNotAgreed(f"{self.what}: rank 0 could not finish it ({stage}): "
                                f"{heard['error']}")
            exc.exit_code = heard.get("exit_code") or EXIT_FAILED  # (rank 0's, the job's)
            raise exc
