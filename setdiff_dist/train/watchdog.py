"""A hung rank ends the job within ``train.hang_timeout_s``, named, with every rank's stacks.

A rank that stops making progress (a stuck collective, a dead NIC, a debugger attached, a
SIGSTOP) otherwise holds every other rank in its next collective until the process group's
timeout (``train.collective_timeout_s``, 30 minutes by default), and nothing says which rank.

Each rank runs a :class:`Watchdog` thread. The training loop reports progress to it
(:meth:`Watchdog.beat`, and :func:`setdiff_dist.progress.progress` from below: every phase of
every step, each evaluation batch, each file a save hashes); the thread writes, every ``poll``
seconds, the rank's heartbeat file ``run_dir/watchdog/rank<R>.json`` (host, pid, step, phase,
when it last progressed, now). The files live in the run directory, which every rank already
shares for its checkpoints, so the watch needs nothing from the process group, rank 0 or its
store, any of which may be the thing that hangs.

When a rank has made no progress for ``hang_timeout_s`` (its peers, blocked in a collective on
the hung rank, reach that point too), or finds the hang report another rank wrote:

1. the first to see it claims the report (``hang.claim``: it alone reads every heartbeat, the
   others wait for its report, so a hang at N ranks costs each O(1) file reads) and writes
   ``run_dir/watchdog/hang.json``: the culprit is the rank whose
   heartbeat stopped (the process is stopped or gone), else the one whose progress stopped
   first (the others then waited for it); it prints one line naming that rank and its host;
2. every rank's Python stacks go to ``run_dir/watchdog/stacks-rank<R>.txt``: each watchdog
   dumps its own process (:func:`faulthandler.dump_traceback`), and the one that reports sends
   ``SIGUSR2`` to each rank on its host whose heartbeat stopped (each rank registers
   :func:`faulthandler.register` for it, which runs in C, even with the main thread blocked),
   then ``SIGCONT``, so that a stopped process writes its stacks too;
3. the rank exits with :data:`EXIT_HUNG`; the launcher (ours, torchrun's agent, ``srun
   --kill-on-bad-exit``) takes the rest down. The checkpoints are untouched: a save is written
   into a new directory and ``latest`` moves only once it is complete.

Sections of the work have their own time without progress (``limits``: phase -> seconds, with
the config key that sets it): the trainer's start-up (process groups, data, the model, the
engine, a conversion and the load: ``train.startup_timeout_s``, watched from before the process
groups exist by a watch of its own, :func:`startup_watch`) and a checkpoint save
(``train.save_timeout_s``); every other phase has ``hang_timeout_s``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from setdiff_dist.checkpoint.format import (
    FAULTS,
    HANG_CLAIM,
    HANG_REPORT,
    WATCHDOG,
    heartbeat_file,
    is_heartbeat_name,
    stacks_file,
)
from setdiff_dist.errors import EXIT_HUNG
from setdiff_dist.progress import watch, watched_by

# the phases of the trainer's start-up (train.startup_timeout_s)
STARTUP_PHASES = ("start-up", "model build", "engine build", "checkpoint load")

# the watch's files, in the run directory (named in setdiff_dist.checkpoint.format)
DIRECTORY = WATCHDOG
REPORT = HANG_REPORT
CLAIM = HANG_CLAIM  # (the rank that writes the report, first come)


def heartbeat_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, DIRECTORY, heartbeat_file(rank))


def stacks_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, DIRECTORY, stacks_file(rank))


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)


def read_heartbeats(run_dir: str) -> dict[int, dict]:
    """Every rank's last heartbeat: rank -> its record (unreadable files skipped)."""
    found = {}
    directory = os.path.join(run_dir, DIRECTORY)
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if is_heartbeat_name(name):
            try:
                with open(os.path.join(directory, name)) as fh:
                    record = json.load(fh)
                found[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                pass
    return found


def restart_count() -> int:
    """Which restart of the job this process is (0: the first start): ours (``SETDIFF_RESTART``) or
    torchrun's elastic agent's (``TORCHELASTIC_RESTART_COUNT``)."""
    for key in ("SETDIFF_RESTART", "TORCHELASTIC_RESTART_COUNT"):
        try:
            return int(os.environ[key])
        except (KeyError, ValueError):
            continue
    return 0


def attempt_id() -> dict:
    """Which allocation of which job this process belongs to: the job (Slurm's job id, else
    torch elastic's run id, which torchrun --standalone makes up for each launch) and Slurm's
    requeue count. The in-job restarts of one allocation share it: a record with the same id
    was written by an earlier start of this allocation."""
    return {"job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
            or os.environ.get("SETDIFF_LAUNCH_ID"),
            "allocation": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}


def record_fault(run_dir: str, kind: str, **detail) -> None:
    """One line of ``run_dir/faults.jsonl``, the job's history of faults: the Slurm launcher
    excludes a node only when the hang reports of one job name it twice."""
    line = json.dumps({"time": time.time(), **attempt_id(), "kind": kind, **detail})
    try:
        with open(os.path.join(run_dir, FAULTS), "a") as fh:
            fh.write(line + "\n")
    except OSError:
        pass  # (a full disk must not keep a hung rank alive)


def culprit(beats: dict[int, dict], now: float, stale_after: float) -> tuple[int, bool]:
    """The rank to blame for a hang, and whether its heartbeat stopped: a rank whose watchdog
    no longer writes (stopped, or dead) first, else the rank whose progress stopped first."""
    silent = [r for r, b in beats.items() if now - b["alive_at"] > stale_after]
    pool = silent or list(beats)
    rank = min(pool, key=lambda r: (beats[r]["progress_at"], r))
    return rank, bool(silent)


class Watchdog:
    """The hang watch of one rank (see the module's docstring). ``beat`` is the training loop's
    progress report; ``on_hang(report)`` runs just before the rank exits (rank 0 records the
    outcome there)."""

    def __init__(self, run_dir: str, timeout_s: float, rank: int, world: int,
                 poll_s: Optional[float] = None,
                 on_hang: Optional[Callable[[dict], None]] = None,
                 limits: Optional[dict[str, tuple[float, str]]] = None,
                 phase: str = "start", key: str = "train.hang_timeout_s",
                 keep_directory: bool = False):
        self.run_dir, self.timeout, self.rank, self.world = run_dir, float(timeout_s), rank, world
        # phase -> (seconds without progress, the config key that sets it); 0: not watched
        self.limits = {k: (float(v), name) for k, (v, name) in (limits or {}).items()}
        self.key = key  # (the config key of timeout_s)
        # (a watch that another follows, the start-up's, leaves the directory: the next one
        # of another rank may be opening its files in it)
        self.keep_directory = keep_directory
        shortest = min([self.timeout] + [v for v, _ in self.limits.values() if v > 0])
        self.poll = poll_s or min(5.0, max(0.2, shortest / 8))
        self.stale_after = 3 * self.poll + 2.0  # a heartbeat older than this: the rank is silent
        self.host = socket.gethostname()
        # the scheduler's name of the node (Slurm's emulated nodes share one host name)
        self.node = os.environ.get("SLURMD_NODENAME") or self.host
        self.on_hang = on_hang
        self._step, self._phase = 0, phase
        self._progress_mono, self._progress_wall = time.monotonic(), time.time()
        for attempt in range(3):  # (another rank's watch may remove it as it ends: again)
            os.makedirs(os.path.join(run_dir, DIRECTORY), exist_ok=True)
            try:
                self._stacks = open(stacks_path(run_dir, rank), "w")
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        self._registered = False
        if threading.current_thread() is threading.main_thread():
            faulthandler.register(signal.SIGUSR2, file=self._stacks, all_threads=True,
                                  chain=False)
            self._registered = True
        self._stop = threading.Event()
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._watch, name="setdiff-watchdog", daemon=True)
        self._thread.start()
        watch(self.beat)  # (setdiff_dist.progress: what the loop and the layers below report)

    # -- the training loop's side ----------------------------------------------------------------
    def limit(self) -> tuple[float, str]:
        """The time without progress allowed in the current phase, and its config key (0: not
        watched)."""
        return self.limits.get(self._phase, (self.timeout, self.key))

    def beat(self, phase: Optional[str] = None, step: Optional[int] = None) -> None:
        """Progress: cheap enough for every phase of every step."""
        if phase is not None:
            self._phase = phase
        if step is not None:
            self._step = step
        self._progress_mono, self._progress_wall = time.monotonic(), time.time()

    def close(self) -> None:
        """The loop ended (any way but a hang): stop watching and remove this rank's files."""
        if watched_by(self.beat):
            watch(None)
        self._stop.set()
        self._thread.join(timeout=10 * self.poll)
        if self._registered:
            faulthandler.unregister(signal.SIGUSR2)
            self._registered = False
        self._stacks.close()
        stacks = stacks_path(self.run_dir, self.rank)
        for path in (heartbeat_path(self.run_dir, self.rank), stacks):
            try:
                if path != stacks or os.path.getsize(path) == 0:
                    os.remove(path)
            except OSError:
                pass
        if self.keep_directory:
            return
        try:
            os.rmdir(os.path.join(self.run_dir, DIRECTORY))  # (the last rank out, if empty)
        except OSError:
            pass

    # -- the thread ------------------------------------------------------------------------------
    def _write_heartbeat(self) -> None:
        try:
            _write_json(heartbeat_path(self.run_dir, self.rank),
                        {"rank": self.rank, "host": self.host, "node": self.node,
                         "pid": os.getpid(), "attempt": attempt_id(),
                         "step": self._step, "phase": self._phase,
                         "progress_at": self._progress_wall, "alive_at": time.time()})
        except OSError:
            pass  # (a full disk must not end the run from here)

    def _watch(self) -> None:
        report = os.path.join(self.run_dir, DIRECTORY, REPORT)
        while not self._stop.wait(self.poll):
            self._write_heartbeat()
            idle = time.monotonic() - self._progress_mono
            allowed, _ = self.limit()
            if allowed and idle > allowed:
                self._hang(self._report(idle))
            elif os.path.exists(report):  # another rank found the hang
                try:
                    with open(report) as fh:
                        found = json.load(fh)
                except (OSError, ValueError):
                    continue
                if self._stop.is_set():
                    return
                if found.get("reported_by_host") != self.host:  # (else already dumped)
                    self._dump(f"the hang rank {found.get('reported_by')} reported")
                self._exit(found)

    def _claimed_by_another(self) -> bool:
        """Whether another rank is writing the hang report: the first rank to see the hang
        claims it (``hang.claim``) and alone reads every heartbeat, so that at N ranks a hang
        costs each rank O(1) file reads, not N; the others wait for its report (True), and
        report themselves if none comes within a heartbeat's staleness (the claimer died)."""
        directory = os.path.join(self.run_dir, DIRECTORY)
        try:
            os.close(os.open(os.path.join(directory, CLAIM),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return False
        except FileExistsError:
            pass
        except OSError:
            return False
        deadline = time.monotonic() + self.stale_after
        while time.monotonic() < deadline:
            if os.path.exists(os.path.join(directory, REPORT)):
                return True
            time.sleep(min(0.2, self.poll))
        return False

    def _report(self, idle: float) -> Optional[dict]:
        """Write the hang report if no rank has (the first wins), and say it; the report."""
        if self._claimed_by_another():
            return None
        now = time.time()
        beats = read_heartbeats(self.run_dir)
        beats[self.rank] = dict(beats.get(self.rank, {}), rank=self.rank, host=self.host,
                                node=self.node, pid=os.getpid(), step=self._step, phase=self._phase,
                                progress_at=self._progress_wall, alive_at=now)
        who, silent = culprit(beats, now, self.stale_after)
        b = beats[who]
        missing = sorted(set(range(self.world)) - set(beats))
        node = b.get("node", b["host"])
        report = {"rank": who, "host": b["host"], "node": node, "pid": b["pid"],
                  "step": b["step"],
                  "phase": b["phase"], "heartbeat_stopped": silent,
                  "no_progress_s": round(now - b["progress_at"], 1),
                  "reported_by": self.rank, "reported_by_host": self.host,
                  "hang_timeout_s": self.timeout, "time": now,
                  "ranks": {str(r): {k: x[k] for k in ("host", "step", "phase")}
                            | {"no_progress_s": round(now - x["progress_at"], 1),
                               "heartbeat_age_s": round(now - x["alive_at"], 1)}
                            for r, x in sorted(beats.items())},
                  "ranks_without_heartbeat": missing}
        allowed, key = self.limit()
        report.update(timeout_s=allowed, timeout_key=key)
        path = os.path.join(self.run_dir, DIRECTORY, REPORT)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return None  # another rank reported it: it dumps its host's stacks
        with os.fdopen(fd, "w") as fh:
            json.dump(report, fh, indent=1)
        record_fault(self.run_dir, "hang", rank=who, node=node, step=b["step"],
                     phase=b["phase"])
        if silent:
            what = (f"stopped responding: its heartbeat stopped {now - b['alive_at']:.0f} s "
                    f"ago (at step {b['step']}, {b['phase']}), the process is stopped or gone")
        else:
            what = (f"has made no progress for {report['no_progress_s']:.0f} s, at step "
                    f"{b['step']} in {b['phase']}, the first to stop (the others then waited "
                    "for it)")
        where = node if node == b["host"] else f"{node} (host {b['host']})"
        print(f"setdiff-train: hang: rank {who} on {where} (pid {b['pid']}) {what}; "
              f"{key}={allowed:g}. Every rank's "
              f"stacks: {os.path.join(self.run_dir, DIRECTORY, stacks_file('*'))}. Exiting "
              f"with code {EXIT_HUNG}; resume=auto goes on from the last checkpoint"
              + (f" (ranks {missing} never wrote a heartbeat)" if missing else ""),
              file=sys.stderr, flush=True)
        # the silent ranks on this host dump their stacks from their signal handler, in C
        for r, x in beats.items():
            if r != self.rank and x["host"] == self.host and now - x["alive_at"] > \
                    self.stale_after:
                for sig in (signal.SIGUSR2, signal.SIGCONT):
                    try:
                        os.kill(int(x["pid"]), sig)
                    except (OSError, ValueError):
                        pass
        return report

    def _hang(self, report: Optional[dict]) -> None:
        allowed, key = self.limit()
        self._dump(f"no progress for {allowed:g} s ({key}) in {self._phase}")
        self._dump_nccl_trace()
        if report is None:
            try:
                with open(os.path.join(self.run_dir, DIRECTORY, REPORT)) as fh:
                    report = json.load(fh)
            except (OSError, ValueError):
                report = {}
        time.sleep(min(2.0, self.poll))  # (the signalled ranks write their stacks)
        self._exit(report)

    def _dump(self, why: str) -> None:
        try:
            self._stacks.write(f"rank {self.rank} on {self.host} (pid {os.getpid()}), step "
                               f"{self._step}, phase {self._phase}: {why}\n")
            self._stacks.flush()
            faulthandler.dump_traceback(file=self._stacks, all_threads=True)
            self._stacks.flush()
        except (OSError, ValueError):
            pass

    def _dump_nccl_trace(self) -> None:
        """Where NCCL's flight recorder runs (``run_dir/nccl_trace/`` exists:
        :func:`setdiff_dist.parallel.state.flight_recorder_env`), its record of this rank's
        last collectives, beside the stacks, before the rank exits (NCCL's own dump comes only
        when a collective times out, after ``train.collective_timeout_s``)."""
        from setdiff_dist.parallel.state import NCCL_TRACE  # (its owner: it turns it on)

        directory = os.path.join(self.run_dir, NCCL_TRACE)
        if not os.path.isdir(directory):
            return
        try:
            import torch

            trace = torch._C._distributed_c10d._dump_nccl_trace()
            with open(os.path.join(directory, f"rank{self.rank}"), "wb") as fh:
                fh.write(trace)
        except Exception:  # noqa: BLE001 (nothing may keep a hung rank alive)
            pass

    def _exit(self, report: dict) -> None:
        if self.on_hang is not None:
            try:
                self.on_hang(report)
            except Exception:  # noqa: BLE001 (nothing may keep a hung rank alive)
                pass
        sys.stderr.flush()
        os._exit(EXIT_HUNG)


def startup_watch(cfg, rank: int, world: int) -> Optional[Watchdog]:
    """The watch of a trainer's start-up (:data:`STARTUP_PHASES`, ``train.startup_timeout_s``;
    None when 0): the caller moves it through the phases with ``beat`` and closes it when the
    start-up ends, whatever way; the training loop's own watch follows."""
    t = cfg.train
    if not t.startup_timeout_s:
        return None
    return Watchdog(cfg.run_dir, t.startup_timeout_s, rank, world, phase=STARTUP_PHASES[0],
                    key="train.startup_timeout_s", keep_directory=True)
