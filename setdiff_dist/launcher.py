"""``setdiff-train --nproc-per-node N``'s launcher on one machine: start the ranks, hand the
stop signals on, and when a rank fails stop the others and start every rank again from the last
checkpoint, within ``train.max_restarts`` (:func:`launch`); and the stop signals a process keeps
from its first line (:data:`SIGNALS`). Imports nothing heavy: the launcher never builds a model.

Under torchrun or Slurm their agents do this job (``launchers/``); this one is for a single
machine without them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from setdiff_dist.errors import EXIT_FAILED, EXIT_HUNG, EXIT_STOPPED, restartable

COMMAND = "setdiff_dist.cli.train"  # what every rank runs (python -m)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Signals:
    """The stop signals this process got, from the first line of ``main``: a signal that comes
    while the ranks still import and build (tens of seconds on a big model), or before the
    launcher has started its ranks, is kept and handed on, never lost to a default action."""

    def __init__(self):
        self.got: list[int] = []
        self.handler = None  # where they go once there is somewhere (the trainer, the ranks)
        self.original: dict = {}
        self.first_int = None

    def install(self, which=STOP_SIGNALS):
        for s in which:
            self.original.setdefault(s, signal.getsignal(s))
            signal.signal(s, self._on)

    def restore(self, which) -> None:
        """Give ``which`` back the handling this process started with."""
        for s in which:
            if s in self.original:
                signal.signal(s, self.original[s])

    def _on(self, signum, frame):
        import time

        if signum == signal.SIGINT and self.first_int is not None:
            if time.monotonic() - self.first_int < 1.0:
                return  # the same Ctrl-C, delivered twice (by the terminal and by torchrun)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if signum == signal.SIGINT:
            self.first_int = time.monotonic()
        if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0" and \
                "SETDIFF_LAUNCHED" not in os.environ:  # (once: by the launcher, or rank 0)
            print("\nsetdiff-train: Ctrl-C: stopping at the next step boundary with a "
                  "checkpoint; Ctrl-C again to abort without one", file=sys.stderr, flush=True)
        self.got.append(signum)
        if self.handler is not None:
            self.handler(signum)

    def hand_to(self, handler) -> None:
        self.handler = handler
        for s in self.got:
            handler(s)


SIGNALS = Signals()


def launch(nproc: int, argv: list[str], grace_s: float = 10.0, max_restarts: int = 0) -> int:
    """Start ``nproc`` ranks of this command on this machine, forward SIGTERM / SIGUSR1 / SIGINT
    to them, and return the first non-zero exit code (or 0). A rank that dies with a failure
    (a crash, a kill, a hang the watchdog ended) ends the attempt: the launcher names it, gives
    the others ``grace_s`` seconds to stop on SIGTERM, then kills them, instead of leaving them
    waiting in a collective for the process group's timeout. Then, up to ``max_restarts``
    times (``train.max_restarts``), every rank starts again and resumes from the last
    checkpoint (``SETDIFF_RESTART``: the trainer resumes with ``resume=auto``); a refusal
    (exit code 2), a divergence (3), a stop signal or a clean end is never restarted
    (:func:`setdiff_dist.errors.restartable`)."""
    from setdiff_dist.processes import threads_per_rank

    threads = {}
    if "OMP_NUM_THREADS" not in os.environ:  # (as torchrun does, but with the CPUs shared out)
        threads = {"OMP_NUM_THREADS": str(threads_per_rank(nproc))}
        print(f"setdiff-train: {threads['OMP_NUM_THREADS']} CPU thread(s) per rank "
              "(OMP_NUM_THREADS overrides)", file=sys.stderr, flush=True)
    restart, launch_id = 0, uuid.uuid4().hex  # (the starts of one launch share its id)
    while True:
        if SIGNALS.got:  # stopped before any rank started: start none
            return 128 + SIGNALS.got[0]
        code, failed = attempt(nproc, argv, grace_s,
                                dict(threads, SETDIFF_RESTART=str(restart),
                                     SETDIFF_LAUNCH_ID=launch_id))
        if failed is None or not restartable(failed[1]) or SIGNALS.got:
            return code
        how = how_ended(failed[1])
        if restart >= max_restarts:
            if max_restarts:
                print(f"setdiff-train: rank {failed[0]} failed again ({how}) and no restart is "
                      f"left (train.max_restarts={max_restarts}, all used): its own output above "
                      "says why; the last checkpoint is intact, and resume=auto goes on from it",
                      file=sys.stderr, flush=True)
            return code
        restart += 1
        print(f"setdiff-train: restart {restart} of {max_restarts} (rank {failed[0]}: {how}): "
              "every rank starts again from the last checkpoint", file=sys.stderr, flush=True)


def how_ended(code: int) -> str:
    if code == EXIT_HUNG:
        return f"a hang, exit code {EXIT_HUNG}"
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def attempt(nproc: int, argv: list[str], grace_s: float, extra_env: dict):
    """One start of every rank (see :func:`launch`): (the exit code, (rank, code) of the first
    rank that failed or None)."""
    import time

    from setdiff_dist.processes import free_port, own_group_and_die_with_parent

    port = str(free_port())
    children = []
    for rank in range(nproc):
        env = dict(os.environ, **extra_env, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, SETDIFF_LAUNCHED="1")
        children.append(subprocess.Popen([sys.executable, "-m", COMMAND] + argv,
                                         env=env, preexec_fn=own_group_and_die_with_parent))

    def forward(signum):
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    SIGNALS.hand_to(forward)
    failed = None
    while None in [c.poll() for c in children]:  # (a list: every child polled, each time)
        dead = [(r, c.returncode) for r, c in enumerate(children)
                if c.returncode is not None and c.returncode not in EXIT_STOPPED]
        if dead and failed is None:
            failed = dead[0]
            if failed[1] == EXIT_HUNG:  # (the watch has named the hung rank)
                print(f"setdiff-train: rank {failed[0]} ended on a hang (exit code "
                      f"{EXIT_HUNG}); stopping the other ranks", file=sys.stderr, flush=True)
            elif restartable(failed[1]):  # (else a refusal or a divergence every rank
                # reaches; it has said why)
                print(f"setdiff-train: rank {failed[0]} died ({how_ended(failed[1])}); "
                      "stopping the other ranks", file=sys.stderr, flush=True)
            for c in children:
                if c.poll() is None:
                    c.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and None in [c.poll() for c in children]:
                time.sleep(0.1)
            for c in children:
                if c.poll() is None:
                    c.kill()
        time.sleep(0.2)
    codes = [c.wait() for c in children]
    if failed is None:
        # (a rank that failed as the last one ended, between two polls)
        failed = next(((r, c) for r, c in enumerate(codes) if c not in EXIT_STOPPED), None)
        if failed is not None and restartable(failed[1]):
            print(f"setdiff-train: rank {failed[0]} died ({how_ended(failed[1])})", file=sys.stderr,
                  flush=True)
    if failed is not None:
        return (failed[1] if failed[1] > 0 else EXIT_FAILED), failed
    return next((c for c in codes if c != 0), 0), None
