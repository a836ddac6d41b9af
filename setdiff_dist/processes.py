"""Child processes that never outlive their parent (the launcher's ranks, the checkpoint
converter) and a free port for their rendezvous. Imports nothing heavy: the launcher of
``setdiff-train --nproc-per-node`` starts its ranks without importing torch."""

from __future__ import annotations

import os
import signal
import socket


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's ``ip_local_port_range``; its default
    elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


# torch's defaults (torchrun's rendezvous 29400, MASTER_PORT 29500): another job's, probably
_TORCH_DEFAULTS = range(29400, 29600)


def free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous that rank 0 binds a moment later.
    Drawn at random below the kernel's ephemeral range: a port of that range, once probed and
    released, is the kernel's to hand to the next outgoing connection of any process (a gloo
    rank's, a store client's) or the next bind to port 0, and rank 0 then fails with
    EADDRINUSE (seen in CI, two test sessions side by side). Below the range only a process
    that names the port itself can take it. Where the range leaves too little room below it,
    the kernel's pick (bind to port 0)."""
    import random

    lo, _ = _ephemeral_ports()
    pool = [p for p in range(10000, lo) if p not in _TORCH_DEFAULTS]
    pick = random.SystemRandom()
    for _ in range(64 if len(pool) >= 1000 else 0):
        port = pick.choice(pool)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # (every address, as the store binds: taken on any is taken)
            except OSError:
                continue
            return port
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
