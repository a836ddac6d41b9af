"""A run's checkpoints as files (names from :mod:`.format`): finding them (the ``latest``
pointer, a lost one recovered, what ``resume`` names), atomic writes, pruning, the run lock and
every file's size and checksum. Plain files: nothing here needs torch or a process group, so
training and inference share it."""

from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional

from setdiff_dist.errors import SetdiffError
from setdiff_dist.paths import sha256_file

from .format import (
    BEST,
    CHECKPOINTS,
    DERIVED_FORMS,
    LATEST,
    MANIFEST,
    RUN_LOCK,
    UNIVERSAL_LOCK,
    checkpoint_root,
    is_complete,
    is_step_name,
)


class CheckpointError(SetdiffError, ValueError):
    """A checkpoint that cannot be used for this run; the message says what differs."""


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_tensors(tensors: dict, path: str, metadata: dict) -> None:
    """``safetensors.torch.save_file``, the file then readable as any file this process makes
    (safetensors creates it 0600, so that an export made for others was theirs to read only
    through a chmod)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets one to read it, which a
    thread creating a file meanwhile would get)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def prune(root: str, keep_last: int, keep: str) -> None:
    """Keep the ``keep_last`` newest complete checkpoints up to ``keep`` (the one just saved),
    and always the one ``best`` names."""
    if keep_last <= 0:
        return
    best = pointed(root, BEST)
    # only checkpoints up to the one just saved: later ones belong to an abandoned run
    complete = sorted(d for d in os.listdir(root) if is_step_name(d) and d <= keep
                      and is_complete(os.path.join(root, d)))
    for d in complete[:-keep_last]:
        if best is None or d != os.path.basename(best):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def pointed(root: str, name: str = LATEST) -> Optional[str]:
    """The checkpoint directory the pointer ``root/name`` (``latest``, ``best``) names, or None
    without that pointer."""
    pointer = os.path.join(root, name)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as fh:
        return os.path.join(root, fh.read().strip())


def pointer_target(path: str) -> str:
    """The step directory a pointer file names (``RUN/checkpoints/best``, ``.../latest``);
    any other path as it is."""
    name = os.path.basename(os.path.normpath(path))
    if name in (LATEST, BEST) and os.path.isfile(path):
        return pointed(os.path.dirname(os.path.normpath(path)) or ".", name)
    return path


def step_directory(path: str) -> str:
    """The checkpoint a run directory or a checkpoints directory points at (``latest``), or a
    pointer file names (``RUN/checkpoints/best``); a step_* directory itself otherwise."""
    path = pointer_target(path)
    return pointed(path) or pointed(os.path.join(path, CHECKPOINTS)) or path


class RunDirBusy(CheckpointError):
    """Another process trains in this run directory."""


class FileLock:
    """A file held with ``flock`` while its holder works, with who holds it (pid, host, since
    when) written inside for the others to name. The file stays (removing a lock file races
    with its next user); the kernel releases the lock when its process dies, so a crash or a
    preemption leaves nothing stale behind."""

    def __init__(self, path: str):
        self.path = path
        self._fh = None

    def acquire(self, blocking: bool = True) -> bool:
        """Hold the lock (at once, or waiting with ``blocking``); False if another holds it.
        An OSError opening the file is the caller's to judge."""
        import fcntl

        if self._fh is not None:
            return True
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError:
            fh.close()
            return False
        fh.seek(0)
        fh.truncate()
        fh.write(_holder())
        fh.flush()
        self._fh = fh
        return True

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it."""
        try:
            with open(self.path) as fh:
                return fh.read().strip() or "another process"
        except OSError:
            return "another process"

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # (closing the file releases the lock)
            self._fh = None


class RunLock(FileLock):
    """``run_dir/.setdiff.lock``, held by the trainer's rank 0 for its whole life: a second
    trainer on the same run directory is refused, naming the owner."""

    NAME = RUN_LOCK

    def __init__(self, run_dir: str):
        super().__init__(os.path.join(run_dir, self.NAME))
        try:
            os.makedirs(run_dir, exist_ok=True)
            held = self.acquire(blocking=False)
        except OSError as exc:
            raise CheckpointError(f"cannot write to run_dir={run_dir} ({exc.strerror}: "
                                  f"{exc.filename}): a run keeps its checkpoints, metrics and "
                                  "logs there; give a writable run_dir") from None
        if not held:
            raise RunDirBusy(f"{run_dir} is in use by {self.holder()}: wait for that run to "
                             "end, stop it, or give this one another run_dir")


def check_writable(run_dir: str) -> None:
    """Refuse, before training, a run whose ``checkpoints/`` cannot be written (its first save
    would fail mid-run): a probe file is created there and removed."""
    root = checkpoint_root(run_dir)
    probe = os.path.join(root, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write("a test that this directory can be written; remove it\n")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"cannot write to {root} ({exc.strerror or exc}): the run saves "
                              "its checkpoints there; make it writable (chmod u+w, or remount "
                              "it read-write) or give another run_dir") from None


class ConversionLock(FileLock):
    """``directory/universal.lock`` (a checkpoint's step directory), held by rank 0 of the job
    that makes, checks or cleans up the checkpoint's universal forms: two jobs that resume one
    checkpoint take turns, and the second finds the first one's form made. In a directory that
    cannot be written nobody converts: the lock is granted at once."""

    def __init__(self, directory: str):
        super().__init__(os.path.join(directory, UNIVERSAL_LOCK))

    def acquire(self, blocking: bool = True) -> bool:
        try:
            return super().acquire(blocking)
        except OSError:
            return True  # (a read-only checkpoint: no conversion can happen there)


def _holder() -> str:
    """What a lock's holder writes into its file: who it is."""
    import socket
    import time

    return (f"pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def complete_checkpoints(run_dir: str) -> list[str]:
    """The step directories of ``run_dir`` with a manifest (written last), oldest first."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root))
            if is_step_name(d) and is_complete(os.path.join(root, d))]


def resolve_latest(run_dir: str) -> Optional[str]:
    """The checkpoint ``latest`` points at in ``run_dir``, or None when there is none yet. A
    lost pointer is recovered from the newest complete checkpoint (never a silent restart)."""
    path = pointed(checkpoint_root(run_dir))
    if path is None:
        complete = complete_checkpoints(run_dir)
        return complete[-1] if complete else None
    if not is_complete(path):
        pointer = os.path.join(checkpoint_root(run_dir), LATEST)
        raise CheckpointError(f"{pointer} points at {path}, which is not a complete "
                              "checkpoint; remove the pointer or set resume=never / a path")
    return path


def resume_path(cfg) -> Optional[str]:
    """The checkpoint directory a run resumes from, per ``cfg.resume``: ``never`` (None),
    ``auto`` (``latest`` of ``cfg.run_dir``, or None before its first save), or a path (a run,
    checkpoints or step directory, which must hold a complete checkpoint)."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return resolve_latest(cfg.run_dir)
    path = step_directory(cfg.resume)
    if not is_complete(path):
        raise CheckpointError(f"resume={cfg.resume}: {path} is not a complete checkpoint (no "
                              f"{MANIFEST}); point at a step_* directory, a checkpoints "
                              "directory or a run directory")
    return path


# ----------------------------------------------------------------------------- file checksums
# The manifest lists every file of a checkpoint with its size and SHA-256 (``"files"``), so
# that a truncated or damaged file is named at load instead of failing deep inside a reader.
# The ranks share the hashing: rank r hashes files r, r + world, ... of the sorted list.

def checkpoint_files(directory: str) -> list[str]:
    """The files of a checkpoint directory, relative and sorted: everything but the manifest
    itself, temporary files and the derived universal forms (which have manifests of their
    own) and their lock."""
    derived = {*DERIVED_FORMS, *(form + ".tmp" for form in DERIVED_FORMS)}
    out = []
    for base, dirs, files in os.walk(directory):
        rel = os.path.relpath(base, directory)
        if rel == ".":
            dirs[:] = [d for d in dirs if d not in derived]
        for f in files:
            path = os.path.normpath(os.path.join(rel, f))
            if path not in (MANIFEST, UNIVERSAL_LOCK) and ".tmp-" not in f:
                out.append(path)
    return sorted(out)


def derived_files(directory: str) -> tuple[list[str], dict[str, str]]:
    """The files of a derived form (``universal/``, ``universal_zero3/``), relative and sorted,
    but for its manifest and temporary files; and its symbolic links, each with its target."""
    files, links = [], {}
    for base, dirs, names in os.walk(directory):
        rel = os.path.relpath(base, directory)
        for name in dirs + names:
            path, key = os.path.join(base, name), os.path.normpath(os.path.join(rel, name))
            if os.path.islink(path):
                links[key] = os.readlink(path)
            elif name in names and key != MANIFEST and ".tmp-" not in name:
                files.append(key)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(base, d))]
    return sorted(files), dict(sorted(links.items()))


def describe_files(directory: str, names: Iterable[str], hashes: bool = True) -> dict:
    """``{name: {"bytes": n, "sha256": hex}}`` for ``names`` under ``directory``."""
    from setdiff_dist.progress import progress

    out = {}
    for name in names:
        progress()  # (a large checkpoint's hashing takes minutes: it is progress)
        path = os.path.join(directory, name)
        out[name] = {"bytes": os.path.getsize(path)}
        if hashes:
            out[name]["sha256"] = sha256_file(path)
    return out


def file_problems(directory: str, table: dict, names: Iterable[str],
                  hashes: bool = True) -> list[str]:
    """What is wrong with ``names`` of ``directory`` against the manifest's ``table``: missing,
    another size, another checksum (``hashes``; sizes alone otherwise)."""
    from setdiff_dist.progress import progress

    problems = []
    for name in names:
        progress()
        want, path = table[name], os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["bytes"]:
            problems.append(f"{name} has {size:,} bytes, the manifest says {want['bytes']:,} "
                            f"({'truncated' if size < want['bytes'] else 'grown'})")
        elif hashes and "sha256" in want and counted_hash(path) != want["sha256"]:
            problems.append(f"{name} does not match its SHA-256 checksum (damaged)")
    return problems


class ReadTally:
    """Bytes this process has read from checkpoint files since :meth:`reset`, by kind."""

    def __init__(self):
        self.by_kind: dict[str, int] = {}

    def reset(self) -> None:
        self.by_kind = {}

    def add(self, kind: str, n: int) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + int(n)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


TALLY = ReadTally()  # (what this process read of checkpoint files: reading.py)


def balance(sizes: list[int], world: int) -> list[int]:
    """An owner rank for each of ``sizes`` such that the ranks' sums are close: the largest
    first, each to the least loaded rank (ties: the lower rank). The same on every rank."""
    owners, load = [0] * len(sizes), [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


def shared_problems(directory: str, table: dict, names: list, hashes: bool = True,
                    group=None) -> list[str]:
    """:func:`file_problems` of ``names``, the work shared by the ranks of ``group`` (a
    torch.distributed group whose ranks all call this; each checks files of about equal bytes
    in all) and every rank given every problem, sorted."""
    if group is None:
        return file_problems(directory, table, names, hashes)
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    owners = balance([table[n].get("bytes", 0) for n in names], world)
    problems = file_problems(directory, table, [n for n, o in zip(names, owners) if o == rank],
                             hashes)
    if world == 1:
        return problems
    every = [None] * world
    dist.all_gather_object(every, problems, group=group)
    return sorted(p for mine in every for p in mine)


def counted_hash(path: str) -> str:
    """The SHA-256 of the file ``path``, its bytes counted as read by the checks
    (:data:`TALLY`)."""
    TALLY.add("verify", os.path.getsize(path))
    return sha256_file(path)


def damaged(path: str, problems: list[str], reading: bool = False) -> CheckpointError:
    """The error for a checkpoint whose files fail their checks: names them and the previous
    complete checkpoint to go back to (``reading``: to read, rather than to resume from)."""
    root, tag = os.path.split(os.path.normpath(path))
    older = [d for d in sorted(os.listdir(root)) if is_step_name(d) and d < tag and
             is_complete(os.path.join(root, d))] if os.path.isdir(root) else []
    if not older:
        hint = "there is no earlier complete checkpoint in this run"
    elif reading:
        hint = f"the previous complete checkpoint is {os.path.join(root, older[-1])}"
    else:
        hint = ("resume from the previous complete checkpoint: "
                f"resume={os.path.join(root, older[-1])}")
    return CheckpointError(f"checkpoint {path} is damaged:\n  - " + "\n  - ".join(problems[:8])
                           + (f"\n  - ... {len(problems) - 8} more" if len(problems) > 8 else "")
                           + f"\n{hint}")
