"""Child processes that never outlive their parent (the launcher's ranks, the checkpoint
converter) and a free port for their rendezvous. Imports nothing heavy: the launcher of
``setdiff-train --nproc-per-node`` starts its ranks without importing torch."""

from __future__ import annotations

import os
import signal
import socket


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads for each of ``local_ranks`` ranks on this machine: the CPUs this process may
    run on, shared out. torch's default, every core in every rank, oversubscribes the CPUs
    ``local_ranks`` times over, and its OpenMP regions then wait on threads the scheduler has
    preempted: on 2 cores with 2 ranks a step takes 1.1x to 3x as long (``torchrun`` sets 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_ranks))


def prctl(option: int, arg) -> bool:
    """Linux's ``prctl(option, arg)`` on this process; False where it failed or there is none."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """In a child (``preexec_fn``): SIGKILL when the parent dies, even by SIGKILL (Linux's
    ``PR_SET_PDEATHSIG``), so that a killed job leaves no process behind to keep writing."""
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def name_process(name: str) -> None:
    """Name this process (``ps -o comm``, ``top``; Linux's ``PR_SET_NAME``, 15 bytes)."""
    prctl(15, name.encode()[:15])


def adopt_orphans() -> bool:
    """Make this process the *child subreaper* of its descendants (Linux's
    ``PR_SET_CHILD_SUBREAPER``): an orphaned descendant becomes its child, which it waits for
    and signals. False where that cannot be done."""
    return prctl(36, 1)


def own_group_and_die_with_parent() -> None:
    """In a child: a process group of its own (a terminal's Ctrl-C reaches the parent alone,
    which forwards it once) and :func:`die_with_parent`."""
    os.setpgid(0, 0)
    die_with_parent()
