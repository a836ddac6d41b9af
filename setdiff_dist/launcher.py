"""``setdiff-train --nproc-per-node N``'s launcher on one machine: start the ranks, hand the
stop signals on, and when a rank fails stop the others and start every rank again from the last
checkpoint, within ``train.max_restarts`` (:func:`launch`); and the stop signals a process keeps
from its first line (:data:`SIGNALS`). Imports nothing heavy: the launcher never builds a model.

Under torchrun or Slurm their agents do this job (``launchers/``); this one is for a single
machine without them. On a CPU machine its ranks are forked by :mod:`setdiff_dist.rank_server`
(:class:`RankServer`), which imports the training stack once for every rank and restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from setdiff_dist.errors import EXIT_FAILED, EXIT_HUNG, EXIT_STOPPED, SetdiffError, restartable

COMMAND = "setdiff_dist.cli.train"  # what every rank runs (python -m)
SERVER = "setdiff_dist.rank_server"  # what forks them (python -m), where it does
# the longest a rank server may take to fork a rank: its imports (seconds; minutes on a cold
# network file system) the first time, a fork after that
SERVER_REPLY_S = 600.0


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
    server = RankServer(dict(os.environ, **threads)) if warm_start() else None
    try:
        while True:
            if SIGNALS.got:  # stopped before any rank started: start none
                return 128 + SIGNALS.got[0]
            code, failed = attempt(nproc, argv, grace_s,
                                    dict(threads, SETDIFF_RESTART=str(restart),
                                         SETDIFF_LAUNCH_ID=launch_id), server)
            if failed is None or not restartable(failed[1]) or SIGNALS.got:
                return code
            restart = next_restart(restart, max_restarts, failed)
            if restart is None:
                return code
    finally:
        if server is not None:
            server.close()


def next_restart(restart: int, max_restarts: int, failed) -> int | None:
    """The number of the restart after ``failed`` (rank, exit code), said; None when none is
    left."""
    how = how_ended(failed[1])
    if restart >= max_restarts:
        if max_restarts:
            print(f"setdiff-train: rank {failed[0]} failed again ({how}) and no restart is "
                  f"left (train.max_restarts={max_restarts}, all used): its own output above "
                  "says why; the last checkpoint is intact, and resume=auto goes on from it",
                  file=sys.stderr, flush=True)
        return None
    restart += 1
    print(f"setdiff-train: restart {restart} of {max_restarts} (rank {failed[0]}: {how}): "
          "every rank starts again from the last checkpoint", file=sys.stderr, flush=True)
    return restart


def how_ended(code: int) -> str:
    if code == EXIT_HUNG:
        return f"a hang, exit code {EXIT_HUNG}"
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def warm_start() -> bool:
    """Whether the ranks are forked by the rank server (:mod:`setdiff_dist.rank_server`): where
    there is no NVIDIA driver, unless ``SETDIFF_WARM_START=0`` (``=1`` forces it); and only
    where this process can adopt them (Linux)."""
    from setdiff_dist.processes import adopt_orphans

    wanted = os.environ.get("SETDIFF_WARM_START", "")
    if wanted not in ("", "0", "1"):
        raise SetdiffError(f"SETDIFF_WARM_START={wanted!r}: set 0 (every rank its own "
                           "interpreter) or 1 (ranks forked by one process that imported the "
                           "stack), or unset it (1 where there is no NVIDIA driver)")
    if wanted == "0" or (wanted == "" and os.path.exists("/dev/nvidiactl")):
        return False
    if not adopt_orphans():
        print("setdiff-train: this system cannot make the launcher adopt forked ranks "
              "(PR_SET_CHILD_SUBREAPER): every rank imports the stack itself",
              file=sys.stderr, flush=True)
        return False
    return True


class RankServerLost(SetdiffError):
    """The rank server ended before it started a rank: exit 1 (what it printed says why)."""

    exit_code = EXIT_FAILED


class Adopted:
    """A rank forked by the rank server and adopted by this process: the part of
    :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def _reap(self, flags: int) -> None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self):
        self._reap(os.WNOHANG)
        return self.returncode

    def wait(self) -> int:
        self._reap(0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankServer:
    """This launcher's end of :mod:`setdiff_dist.rank_server`: started at the first rank, kept
    for the ranks of a restart, closed at the end of the launch."""

    def __init__(self, env: dict):
        self.env, self.proc, self.replies, self.pending = env, None, None, b""

    def _start(self) -> None:
        from setdiff_dist.processes import own_group_and_die_with_parent

        self.close()
        reply, into = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", SERVER,
                                      str(into)], stdin=subprocess.PIPE, pass_fds=(into,),
                                     env=self.env, preexec_fn=own_group_and_die_with_parent)
        os.close(into)
        self.replies, self.pending = reply, b""

    def start(self, rank: int, argv: list[str], env: dict) -> Adopted:
        """Rank ``rank`` of ``setdiff-train argv`` with the environment ``env``, adopted."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        request = {"rank": rank, "argv": argv, "env": env, "launcher": os.getpid()}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # (the server has died: said below)
        line = self._line(time.monotonic() + SERVER_REPLY_S)
        if line is None:
            try:
                code = self.proc.wait(timeout=2.0)  # (its pipe has closed: it is ending)
            except subprocess.TimeoutExpired:  # (hung: in its imports, or a fork that never came)
                self.proc.kill()
                raise RankServerLost(
                    f"the rank server (pid {self.proc.pid}) started no rank {rank} within "
                    f"{SERVER_REPLY_S:.0f} s and was killed (SETDIFF_WARM_START=0 starts every "
                    "rank as its own interpreter)") from None
            raise RankServerLost(
                f"the rank server (pid {self.proc.pid}) ended with exit code {code} before "
                f"rank {rank} started: its output above says why (SETDIFF_WARM_START=0 starts "
                "every rank as its own interpreter)")
        said, pid = map(int, line.split())
        assert said == rank, (said, rank)
        return Adopted(pid)

    def _line(self, deadline: float):
        """The next reply line, or None once the server has ended without one or ``deadline``
        (``time.monotonic()``) has passed."""
        import select

        while b"\n" not in self.pending:
            if time.monotonic() > deadline:
                return None
            ready, _, _ = select.select([self.replies], [], [], 1.0)
            if ready:
                data = os.read(self.replies, 4096)
                if not data:
                    return None
                self.pending += data
            elif self.proc.poll() is not None:
                return None
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            os.close(self.replies)
            self.proc = None


def attempt(nproc: int, argv: list[str], grace_s: float, extra_env: dict,
            server: RankServer | None = None):
    """One start of every rank (see :func:`launch`), forked by ``server`` or executed: (the
    exit code, (rank, code) of the first rank that failed or None)."""
    from setdiff_dist.processes import free_port, own_group_and_die_with_parent

    port = str(free_port())
    children = []
    for rank in range(nproc):
        env = dict(os.environ, **extra_env, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, SETDIFF_LAUNCHED="1")
        if server is not None:
            children.append(server.start(rank, argv, env))
        else:
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
